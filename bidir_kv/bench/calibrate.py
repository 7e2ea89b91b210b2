"""A cost model measured by ``bench``: fit recompute and pull costs from a result directory.

* recompute µs/token: OFF leg, router prefill duration against tokens P computed per
  request (least squares with an intercept, which absorbs HTTP and queueing).
* pull: ON leg, ``vllm:nixl_xfer_time_seconds`` per transfer against tokens pulled
  per transfer; the intercept is the fixed per-pull overhead.
"""

from __future__ import annotations

from collections.abc import Sequence

from bidir_kv.bench.plan import CostModel, PlanError
from bidir_kv.bench.results import LegPoint, ResultDir
from bidir_kv.bench.summary import summarize_result

__all__ = ["calibrate", "linear_fit"]


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) by least squares; one point gives a line through the origin."""
    if not xs or len(xs) != len(ys):
        raise PlanError("a fit needs at least one (x, y) pair")
    if len(xs) == 1 or len(set(xs)) == 1:
        x = sum(xs) / len(xs)
        y = sum(ys) / len(ys)
        return 0.0, (y / x if x else 0.0)
    n = len(xs)
    mx = sum(xs) / n
    my = sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    return my - slope * mx, slope


def calibrate(result: ResultDir, kv_bytes_per_token: float | None = None) -> CostModel:
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
    xs = [r.tokens_local_compute / r.prefill_count for r in off]
    ys = [(r.prefill_ms or 0.0) * 1e3 for r in off]
    _, recompute = linear_fit(xs, ys)
    if recompute <= 0:
        raise PlanError(
            f"{result.path}: OFF prefill time did not grow with the tokens P computed "
            f"(slope {recompute:.3g} µs/token); the run is too small or too noisy to calibrate"
        )
    px = [r.tokens_external / r.xfer_count for r in on]
    py = [(r.xfer_ms_per_transfer or 0.0) * 1e3 for r in on]
    overhead, per_token = linear_fit(px, py)
    if kv_bytes_per_token is None:
        kv_bytes_per_token = _measured_bytes_per_token(on)
    notes = (
        f"calibrated from {result.path}: {len(off)} OFF and {len(on)} ON points",
        f"recompute fit over {', '.join(f'{x:.0f}' for x in xs)} tokens/request",
        f"pull fit over {', '.join(f'{x:.0f}' for x in px)} tokens/transfer",
    )
    return CostModel(
        recompute_us_per_token=recompute,
        recompute_us_per_token_ctx=0.0,
        xfer_us_per_token=max(per_token, 0.0),
        pull_overhead_us=max(overhead, 0.0),
        kv_bytes_per_token=kv_bytes_per_token,
        source="calibration",
        notes=notes,
    )


def _measured_bytes_per_token(on: Sequence[LegPoint]) -> float:
    total_tokens = sum(r.tokens_external for r in on)
    total_bytes = sum((r.mb_per_transfer or 0.0) * 2**20 * r.xfer_count for r in on)
    return total_bytes / total_tokens if total_tokens else 0.0
