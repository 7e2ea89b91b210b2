"""A cost model measured by ``bench``: the planner's terms fitted to a result directory.

The same terms as a derived profile (docs/profiles.md §6), from the ``/metrics``
deltas ``bench`` records per point:

* recompute µs/token and a per-request fixed part: OFF leg, the router's prefill
  histogram (mean per request) against the tokens P computed per request;
* pull fixed, per descriptor and per byte: ON leg, P's ``vllm:nixl_xfer_time_seconds``
  against ``vllm:nixl_num_descriptors`` and ``vllm:nixl_bytes_transferred`` (means per
  rank-level transfer, bidir_kv.plan.fit);
* step granularity: what the ON leg's router prefill holds beyond the per-request
  part, the uncached tail and the transfers, per pull against tokens per pull: the
  intercept is half a step (``step_us``), the slope P's own work per pulled token
  (``pull_after_us_per_token``);
* contention (bidir_kv.plan.contention): with several clients on one P, the wait
  for each other's compute, replayed from the run's own arrivals; both fits above
  are made on the prefill less that wait, so the per-request terms stay per request.

``check_rows`` puts the calibration next to its own run, point by point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from bidir_kv.bench.results import LegPoint, ResultDir
from bidir_kv.bench.summary import summarize_result
from bidir_kv.plan.contention import Arrival, arrivals, mean_wait_us
from bidir_kv.plan.fit import PullFit, fit_pull, linear_fit
from bidir_kv.plan.planner import DEFAULT_BLOCK_SIZE, CostModel, PlanError
from bidir_kv.plan.tail import Tail, prefill_tail

__all__ = ["CheckRow", "calibrate", "check_rows", "linear_fit"]


@dataclass(frozen=True)
class _OnPoint:
    """One ON point per request: pulls, computed tokens, tokens per pull (TP ranks folded)."""

    row: LegPoint
    pulls_per_request: float
    computed_per_request: float
    tokens_per_pull: float
    arrivals: tuple[Arrival, ...] = ()


@dataclass(frozen=True)
class CheckRow:
    """Measured vs predicted router prefill per request (ms) at one point."""

    point: int
    off_ms: float | None
    off_pred_ms: float | None
    on_ms: float | None
    on_pred_ms: float | None
    off_wait_ms: float = 0.0  # of the prediction: contention (waiting for others' compute)
    on_wait_ms: float = 0.0
    off_tail: Tail | None = None  # the few requests far beyond the median (plan.tail)
    on_tail: Tail | None = None

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


def _arrivals(result: ResultDir, r: LegPoint) -> tuple[Arrival, ...]:
    engines = result.manifest.get("engines") or {}
    records = result.points.get((r.leg, r.point), ([], {}))[0]
    return tuple(
        arrivals(
            records,
            computed_total=r.tokens_local_compute,
            pulled_total=r.tokens_external,
            block_size=int(engines.get("block_size") or DEFAULT_BLOCK_SIZE),
            threshold=int(engines.get("kv_recompute_threshold") or 0),
        )
    )


def _on_point(result: ResultDir, r: LegPoint, tp: int) -> _OnPoint:
    pulls = r.xfer_count / tp
    requests = r.prefill_count or pulls
    computed = r.tokens_local_compute / requests
    return _OnPoint(r, pulls / requests, computed, r.tokens_external / pulls, _arrivals(result, r))


def _fit_transfers(on: Sequence[LegPoint]) -> PullFit:
    times = [(r.xfer_ms_per_transfer or 0.0) * 1e3 for r in on]
    nbytes = [(r.mb_per_transfer or 0.0) * 2**20 for r in on]
    descs = [r.descriptors_per_transfer or 0.0 for r in on]
    return fit_pull(times, descs, nbytes)


def _line(xs: Sequence[float], ys: Sequence[float], ws: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope), weighted; a negative intercept is noise: through the origin."""
    fixed, slope = linear_fit(xs, ys, ws)
    if fixed < 0:
        num = sum(w * w * x * y for x, y, w in zip(xs, ys, ws, strict=True))
        return 0.0, num / sum(w * w * x * x for x, w in zip(xs, ws, strict=True))
    return fixed, slope


def _relative(ys: Sequence[float]) -> list[float]:
    """Weights 1/y: the fits minimise relative error (assumption: a shared machine's noise
    stretches a whole request, so it is proportional to the time, docs/profiles.md §6)."""
    return [1.0 / y if y > 0 else 0.0 for y in ys]


def _fit_recompute(
    xs: Sequence[float], ys: Sequence[float], arrs: Sequence[Sequence[Arrival]]
) -> tuple[float, float]:
    """(per-request µs, µs/token) of the OFF prefill less the contention wait it implies.

    The wait grows with the slope (more work per request, longer queues), so the
    slope is searched: for each candidate the intercept is the least-squares one
    of the prefill less the wait, and the candidate with the least squared error
    wins. One client (no overlap at the plain fit's slope) is the plain fit.
    """
    ws = _relative(ys)
    fixed0, slope0 = _line(xs, ys, ws)
    if slope0 <= 0 or not any(mean_wait_us(a, slope0) for a in arrs):
        return fixed0, slope0
    w2 = [w * w for w in ws]

    def sse(b: float) -> tuple[float, float]:
        rest = [y - mean_wait_us(a, b) - b * x for x, y, a in zip(xs, ys, arrs, strict=True)]
        fixed = max(0.0, sum(r * v for r, v in zip(rest, w2, strict=True)) / sum(w2))
        return sum((r - fixed) ** 2 * v for r, v in zip(rest, w2, strict=True)), fixed

    grid = [slope0 * k / 100 for k in range(1, 201)]
    best = min(grid, key=lambda b: sse(b)[0])
    lo, hi = best - slope0 / 100, best + slope0 / 100
    for _ in range(40):  # golden section inside the best grid cell
        m1, m2 = hi - (hi - lo) * 0.618, lo + (hi - lo) * 0.618
        lo, hi = (lo, m2) if sse(m1)[0] <= sse(m2)[0] else (m1, hi)
    slope = (lo + hi) / 2
    return sse(slope)[1], slope


def calibrate(result: ResultDir, kv_bytes_per_token: float | None = None) -> CostModel:
    off, on = _usable(result)
    tp = _tp(result)
    xs = [r.tokens_local_compute / r.prefill_count for r in off]
    ys = [(r.prefill_ms or 0.0) * 1e3 for r in off]
    off_arrs = [_arrivals(result, r) for r in off]
    fixed_req, recompute = _fit_recompute(xs, ys, off_arrs)
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
    points = [_on_point(result, r, tp) for r in on]
    step, after = _residual_fit(cost, points, fitted_pull=False)
    # the wait depends on when a pulled request reaches P's compute: once more with the pull
    step, after = _residual_fit(
        replace(cost, step_us=step, pull_after_us_per_token=after), points, fitted_pull=True
    )
    waits = [mean_wait_us(a, recompute) / 1e3 for a in off_arrs]
    notes = (
        f"calibrated from {result.path}: {len(off)} OFF and {len(on)} ON points",
        f"recompute fit over {', '.join(f'{x:.0f}' for x in xs)} tokens/request"
        + (
            " (through the origin)"
            if fixed_req == 0
            else f" (+ {fixed_req / 1e3:.2f} ms per request)"
        ),
        f"pull: {pull.note}",
        f"beyond the transfer histogram, per pull: {step / 2 / 1e3:.2f} ms (half a step: the "
        f"completion is seen at step granularity) + {after:.3f} µs per pulled token",
        f"contention ({result.manifest.get('num_clients', 1)} client(s) on one P, first come "
        f"first served, replayed): OFF wait {', '.join(f'{w:.1f}' for w in waits)} ms/request",
    )
    return replace(cost, step_us=step, pull_after_us_per_token=after, notes=notes, sources=notes)


def _on_wait_us(cost: CostModel, p: _OnPoint, measured_pull: bool = False) -> float:
    """The point's contention wait; a pulled request reaches P's compute after its pull."""
    per_pull = (
        (p.row.xfer_ms_per_transfer or 0.0) * 1e3
        if measured_pull
        else cost.pull_us(p.tokens_per_pull)
    )
    return mean_wait_us(p.arrivals, cost.recompute_us_per_token, per_pull, p.pulls_per_request)


def _residual_fit(
    cost: CostModel, points: Sequence[_OnPoint], *, fitted_pull: bool
) -> tuple[float, float]:
    """(step_us, µs per pulled token) of what the ON prefill holds beyond the model so far.

    Per pull: the residual (against the measured transfer time, less the
    contention wait) over tokens per pull; the intercept is half a step (the
    completion seen at step granularity), the slope P's own work per pulled
    token. Negative parts are noise and dropped. ``fitted_pull``: the wait is
    replayed with ``cost``'s whole pull (second pass), else with the transfer only.
    """
    xs, ys, ws = [], [], []
    for p in points:
        if p.pulls_per_request <= 0 or not p.row.prefill_ms:
            continue
        # relative to the point's prefill, as the OFF fit (a residual per pull)
        ws.append(p.pulls_per_request / (p.row.prefill_ms * 1e3))
        # against the measured transfer time, so a pull-fit error does not leak in here
        transfers = p.pulls_per_request * (p.row.xfer_ms_per_transfer or 0.0) * 1e3
        rest = cost.prefill_fixed_us + cost.recompute_us(p.computed_per_request)
        rest += _on_wait_us(cost, p, measured_pull=not fitted_pull)
        xs.append(p.tokens_per_pull)
        ys.append((p.row.prefill_ms * 1e3 - rest - transfers) / p.pulls_per_request)
    if not xs:
        return 0.0, 0.0
    w2 = [w * w for w in ws]
    mean = sum(y * v for y, v in zip(ys, w2, strict=True)) / sum(w2)
    if len(set(xs)) == 1:
        return max(0.0, 2 * mean), 0.0
    half_step, per_token = linear_fit(xs, ys, ws)
    if per_token < 0:
        return max(0.0, 2 * mean), 0.0
    if half_step < 0:  # through the origin; a run faster than the model gives no term
        return 0.0, max(0.0, _line(xs, ys, ws)[1])
    return 2 * half_step, per_token


def _on_prefill_us(cost: CostModel, p: _OnPoint) -> float:
    return (
        cost.prefill_fixed_us
        + cost.recompute_us(p.computed_per_request)
        + p.pulls_per_request * cost.pull_us(p.tokens_per_pull)
    )


def check_rows(result: ResultDir, cost: CostModel) -> list[CheckRow]:
    """Per point: the run's router prefill per request next to what ``cost`` predicts.

    The prediction includes the contention wait replayed from the point's own
    arrivals (``*_wait_ms``), so a run with several clients is checked as run.
    """
    rows = summarize_result(result, min_turn=1)
    tp = _tp(result)
    out = []
    for point in result.prefix_points:
        off, on = rows.get("off", point), rows.get("on", point)
        off_pred = on_pred = None
        off_wait = on_wait = 0.0
        if off and off.prefill_count:
            per_req = off.tokens_local_compute / off.prefill_count
            off_wait = mean_wait_us(_arrivals(result, off), cost.recompute_us_per_token) / 1e3
            off_pred = (cost.prefill_fixed_us + cost.recompute_us(per_req)) / 1e3 + off_wait
        if on and on.prefill_count:
            if on.xfer_count and on.tokens_external:
                p = _on_point(result, on, tp)
                on_wait = _on_wait_us(cost, p) / 1e3
                on_pred = _on_prefill_us(cost, p) / 1e3 + on_wait
            else:
                per_req = on.tokens_local_compute / on.prefill_count
                on_wait = mean_wait_us(_arrivals(result, on), cost.recompute_us_per_token) / 1e3
                on_pred = (cost.prefill_fixed_us + cost.recompute_us(per_req)) / 1e3 + on_wait
        out.append(
            CheckRow(
                point,
                off.prefill_ms if off else None,
                off_pred,
                on.prefill_ms if on else None,
                on_pred,
                off_wait,
                on_wait,
                _tail(result, "off", point),
                _tail(result, "on", point),
            )
        )
    return out


def _tail(result: ResultDir, leg: str, point: int) -> Tail | None:
    found = result.points.get((leg, point))
    return prefill_tail(found[1]) if found else None
