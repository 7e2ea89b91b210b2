"""Planner prediction next to a measured sweep: per-point ratios and the crossover.

The cost model comes from the run's emulator profile (the emulator and the
planner share the formulas, docs/profiles.md) or, for real engines, from a
calibration of the run itself. For every reuse turn (turn ≥ 2) the history is
what D holds and P may pull; the prediction is the prefill-only ratio
``recompute(L) / (pull(H) + recompute(L − H, H))``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from bidir_kv.bench.plan import CostModel, PlanError, break_even_tokens
from bidir_kv.bench.report import Report

__all__ = ["PointPrediction", "Prediction", "cost_from_profile", "predict"]


@dataclass(frozen=True)
class PointPrediction:
    point: int
    history_tokens: float
    predicted_ratio: float
    measured_ratio: float | None
    measured_prefill_ratio: float | None


@dataclass(frozen=True)
class Prediction:
    source: str
    break_even_tokens: float
    points: list[PointPrediction]
    measured_crossover: tuple[float, float] | None  # (history below, history above)


def cost_from_profile(name: str) -> CostModel | None:
    """The emulator profile as a planner cost model (time scale applied), if loadable."""
    from bidir_kv.engine.profiles import ProfileError, load_profile

    try:
        p = load_profile(name)
    except (ProfileError, OSError):
        return None
    if p.prefill_us_per_token <= 0 and p.prefill_us_per_token_ctx <= 0:
        return None
    xfer = (
        p.kv_bytes_per_token_target / (p.transfer_gbytes_per_s * 1e3)
        if p.transfer_gbytes_per_s > 0
        else 0.0
    )
    return CostModel(
        recompute_us_per_token=p.prefill_us_per_token * p.time_scale,
        recompute_us_per_token_ctx=p.prefill_us_per_token_ctx * p.time_scale,
        xfer_us_per_token=xfer * p.time_scale,
        pull_overhead_us=p.transfer_overhead_us * p.time_scale,
        kv_bytes_per_token=float(p.kv_bytes_per_token_target),
        source=f"profile {p.name}",
    )


def predict(report: Report) -> Prediction | str:
    """The prediction, or why there is none (no profile costs and no usable calibration)."""
    manifest = report.result.manifest
    cost = cost_from_profile(str(manifest["profile"])) if manifest.get("profile") else None
    if cost is None:
        from bidir_kv.bench.calibrate import calibrate

        try:
            cost = calibrate(report.result)
        except PlanError as exc:
            return str(exc)
    points: list[PointPrediction] = []
    for point in report.result.prefix_points:
        recs = report.result.points.get(("on", point)) or report.result.points.get(("off", point))
        if not recs:
            continue
        reuse = [r for r in recs[0] if r.ok and r.turn >= report.min_turn and r.turn >= 2]
        if not reuse:
            continue
        ratios = []
        hist = []
        for r in reuse:
            length = r.prompt_tokens or r.input_num_tokens
            history = max(0.0, r.input_num_tokens * r.approx_cached_percent / 100.0)
            history = min(history, float(length))
            off = cost.recompute_us(length)
            on = cost.pull_us(history) + cost.recompute_us(length - history, history)
            ratios.append(off / on if on > 0 else math.inf)
            hist.append(history)
        off_row, on_row = report.get("off", point), report.get("on", point)
        measured = prefill = None
        if off_row and on_row and on_row.ttft_median and not math.isnan(on_row.ttft_median):
            measured = off_row.ttft_median / on_row.ttft_median
        if off_row and on_row and off_row.prefill_ms and on_row.prefill_ms:
            prefill = off_row.prefill_ms / on_row.prefill_ms
        points.append(
            PointPrediction(
                point, sum(hist) / len(hist), sum(ratios) / len(ratios), measured, prefill
            )
        )
    crossover = None
    for below, above in itertools.pairwise(points):
        if (
            below.measured_ratio is not None
            and above.measured_ratio is not None
            and below.measured_ratio <= 1.0 < above.measured_ratio
        ):
            crossover = (below.history_tokens, above.history_tokens)
    return Prediction(cost.source, break_even_tokens(cost), points, crossover)
