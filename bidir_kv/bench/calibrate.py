"""A cost model measured by ``bench``: the planner's terms fitted to a result directory.

The same terms as a derived profile (docs/profiles.md §6), from the ``/metrics``
deltas ``bench`` records per point:

* recompute µs/token and a per-request fixed part: OFF leg, the router's prefill
  histogram (mean per request) against the tokens P computed per request;
* pull fixed, per descriptor and per byte: ON leg, P's ``vllm:nixl_xfer_time_seconds``
  against ``vllm:nixl_num_descriptors`` and ``vllm:nixl_bytes_transferred`` (means per
  rank-level transfer, bidir_kv.bench.fit);
* step granularity: what the ON leg's router prefill holds beyond the per-request
  part, the uncached tail and the transfers, per pull against tokens per pull: the
  intercept is half a step (``step_us``), the slope P's own work per pulled token
  (``pull_after_us_per_token``).

``check_rows`` puts the calibration next to its own run, point by point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from bidir_kv.bench.fit import PullFit, fit_pull, linear_fit
from bidir_kv.bench.plan import CostModel, PlanError
from bidir_kv.bench.results import LegPoint, ResultDir
from bidir_kv.bench.summary import summarize_result

__all__ = ["CheckRow", "calibrate", "check_rows", "linear_fit"]


@dataclass(frozen=True)
class _OnPoint:
    """One ON point per request: pulls, computed tokens, tokens per pull (TP ranks folded)."""

    row: LegPoint
    pulls_per_request: float
    computed_per_request: float
    tokens_per_pull: float


@dataclass(frozen=True)
class CheckRow:
    """Measured vs predicted router prefill per request (ms) at one point."""

    point: int
    off_ms: float | None
    off_pred_ms: float | None
    on_ms: float | None
    on_pred_ms: float | None

    @staticmethod
    def error(measured: float | None, predicted: float | None) -> float | None:
        """(predicted − measured) / measured, or None."""
        if not measured or predicted is None:
            return None
        return (predicted - measured) / measured


def _tp(result: ResultDir) -> int:
    engines = result.manifest.get("engines") or {}
    return max(1, int(engines.get("tensor_parallel_size") or 1))


def _usable(result: ResultDir) -> tuple[list[LegPoint], list[LegPoint]]:
    rows = summarize_result(result, min_turn=1).rows
    # points with failed requests are left out: their timings are not the engine's
    off = [r for r in rows if r.leg == "off" and r.prefill_ms and r.prefill_count and not r.errors]
    on = [r for r in rows if r.leg == "on" and r.xfer_count and r.tokens_external and not r.errors]
    if not off:
        raise PlanError(
            f"{result.path}: no OFF points with a router prefill histogram; cannot fit recompute"
        )
    if not on:
        raise PlanError(f"{result.path}: no ON points with KV transfers; cannot fit pull costs")
    return off, on


def _on_point(r: LegPoint, tp: int) -> _OnPoint:
    pulls = r.xfer_count / tp
    requests = r.prefill_count or pulls
    computed = r.tokens_local_compute / requests
    return _OnPoint(r, pulls / requests, computed, r.tokens_external / pulls)


def _fit_transfers(on: Sequence[LegPoint]) -> PullFit:
    times = [(r.xfer_ms_per_transfer or 0.0) * 1e3 for r in on]
    nbytes = [(r.mb_per_transfer or 0.0) * 2**20 for r in on]
    descs = [r.descriptors_per_transfer or 0.0 for r in on]
    return fit_pull(times, descs, nbytes)


def calibrate(result: ResultDir, kv_bytes_per_token: float | None = None) -> CostModel:
    off, on = _usable(result)
    tp = _tp(result)
    xs = [r.tokens_local_compute / r.prefill_count for r in off]
    ys = [(r.prefill_ms or 0.0) * 1e3 for r in off]
    fixed_req, recompute = linear_fit(xs, ys)
    origin = fixed_req < 0
    if origin:  # a negative per-request part is noise: the line through the origin
        fixed_req = 0.0
        recompute = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    if recompute <= 0:
        raise PlanError(
            f"{result.path}: OFF prefill time did not grow with the tokens P computed "
            f"(slope {recompute:.3g} µs/token); the run is too small or too noisy to calibrate"
        )
    pull = _fit_transfers(on)
    total_tokens = sum(r.tokens_external for r in on)
    total_bytes = sum((r.mb_per_transfer or 0.0) * 2**20 * r.xfer_count for r in on)
    total_descs = sum((r.descriptors_per_transfer or 0.0) * r.xfer_count for r in on)
    measured_bpt = total_bytes / total_tokens
    cost = CostModel(
        recompute_us_per_token=recompute,
        recompute_us_per_token_ctx=0.0,
        xfer_us_per_token=pull.us_per_byte * measured_bpt / tp,
        pull_overhead_us=pull.fixed_us,
        kv_bytes_per_token=measured_bpt if kv_bytes_per_token is None else kv_bytes_per_token,
        source="calibration",
        xfer_us_per_descriptor=pull.per_descriptor_us,
        descriptors_per_token=total_descs / (total_tokens * tp) if pull.separable else 0.0,
        prefill_fixed_us=fixed_req,
    )
    step, after = _residual_fit(cost, [_on_point(r, tp) for r in on])
    notes = (
        f"calibrated from {result.path}: {len(off)} OFF and {len(on)} ON points",
        f"recompute fit over {', '.join(f'{x:.0f}' for x in xs)} tokens/request"
        + (" (through the origin)" if origin else f" (+ {fixed_req / 1e3:.2f} ms per request)"),
        f"pull: {pull.note}",
        f"beyond the transfer histogram, per pull: {step / 2 / 1e3:.2f} ms (half a step: the "
        f"completion is seen at step granularity) + {after:.3f} µs per pulled token",
    )
    return replace(cost, step_us=step, pull_after_us_per_token=after, notes=notes, sources=notes)


def _residual_fit(cost: CostModel, points: Sequence[_OnPoint]) -> tuple[float, float]:
    """(step_us, µs per pulled token) of what the ON prefill holds beyond the model so far.

    Per pull: the residual (against the measured transfer time) over tokens per
    pull; the intercept is half a step (the completion seen at step granularity),
    the slope P's own work per pulled token. Negative parts are noise and dropped.
    """
    xs, ys = [], []
    for p in points:
        if p.pulls_per_request <= 0 or not p.row.prefill_ms:
            continue
        # against the measured transfer time, so a pull-fit error does not leak in here
        transfers = p.pulls_per_request * (p.row.xfer_ms_per_transfer or 0.0) * 1e3
        rest = cost.prefill_fixed_us + cost.recompute_us(p.computed_per_request)
        xs.append(p.tokens_per_pull)
        ys.append((p.row.prefill_ms * 1e3 - rest - transfers) / p.pulls_per_request)
    if not xs:
        return 0.0, 0.0
    if len(set(xs)) == 1:
        return max(0.0, 2 * sum(ys) / len(ys)), 0.0
    half_step, per_token = linear_fit(xs, ys)
    if per_token < 0:
        return max(0.0, 2 * sum(ys) / len(ys)), 0.0
    if half_step < 0:  # through the origin; a run faster than the model gives no term
        slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
        return 0.0, max(0.0, slope)
    return 2 * half_step, per_token


def _on_prefill_us(cost: CostModel, p: _OnPoint) -> float:
    return (
        cost.prefill_fixed_us
        + cost.recompute_us(p.computed_per_request)
        + p.pulls_per_request * cost.pull_us(p.tokens_per_pull)
    )


def check_rows(result: ResultDir, cost: CostModel) -> list[CheckRow]:
    """Per point: the run's router prefill per request next to what ``cost`` predicts."""
    rows = summarize_result(result, min_turn=1)
    tp = _tp(result)
    out = []
    for point in result.prefix_points:
        off, on = rows.get("off", point), rows.get("on", point)
        off_pred = None
        if off and off.prefill_count:
            per_req = off.tokens_local_compute / off.prefill_count
            off_pred = (cost.prefill_fixed_us + cost.recompute_us(per_req)) / 1e3
        on_pred = None
        if on and on.prefill_count:
            if on.xfer_count and on.tokens_external:
                on_pred = _on_prefill_us(cost, _on_point(on, tp)) / 1e3
            else:
                per_req = on.tokens_local_compute / on.prefill_count
                on_pred = (cost.prefill_fixed_us + cost.recompute_us(per_req)) / 1e3
        out.append(
            CheckRow(
                point,
                off.prefill_ms if off else None,
                off_pred,
                on.prefill_ms if on else None,
                on_pred,
            )
        )
    return out
