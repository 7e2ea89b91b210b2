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

from bidir_kv.bench.stats import RequestRecord
from bidir_kv.bench.summary import Summary, ratio_rows
from bidir_kv.bench.topo import LegSetup
from bidir_kv.engine.profiles import ProfileError, load_profile
from bidir_kv.plan.calibrate import CheckRow, calibrate, check_rows
from bidir_kv.plan.planner import CostModel, PlanError, break_even_tokens
from bidir_kv.policy import pull_decision

__all__ = ["PointPrediction", "Prediction", "cost_from_profile", "predict", "prediction_cost"]


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
    check: tuple[CheckRow, ...] = ()  # a calibration next to its own run, per point


def cost_from_profile(name: str) -> CostModel | None:
    """The emulator profile as a planner cost model (time scale applied), if loadable."""
    try:
        p = load_profile(name)
    except (ProfileError, OSError):
        return None
    if p.prefill_us_per_token <= 0 and p.prefill_us_per_token_ctx <= 0:
        return None
    pm = p.pull_model
    bw = pm.rank_gbytes_per_s
    byte_us = pm.rank_bytes_per_token / (bw * 1e3) if bw else 0.0
    ts = p.time_scale
    return CostModel(
        recompute_us_per_token=p.prefill_us_per_token * ts,
        recompute_us_per_token_ctx=p.prefill_us_per_token_ctx * ts,
        xfer_us_per_token=byte_us * ts,
        pull_overhead_us=pm.fixed_us * ts,
        kv_bytes_per_token=float(p.kv_bytes_per_token_target),
        source=f"profile {p.name}",
        notes=(p.description,) if p.description else (),
        xfer_us_per_descriptor=pm.per_descriptor_us * ts,
        descriptors_per_token=pm.descriptors_per_block / pm.block_size,
        step_us=pm.step_us * ts,
        sources=p.sources,
        prefill_fixed_us=p.prefill_fixed_us * ts,
        pull_after_us_per_token=p.pull_after_us_per_token * ts,
        decode_ttft_fixed_us=p.decode_ttft_fixed_us * ts,
        decode_ttft_us_per_token=p.decode_ttft_us_per_token * ts,
        uncertainty=p.uncertainty,
        block_size=p.target_block_size,
    )


def prediction_cost(summary: Summary) -> CostModel | str:
    """The run's profile as a cost model, else a calibration of the run, else why neither."""
    manifest = summary.result.manifest
    cost = cost_from_profile(str(manifest["profile"])) if manifest.get("profile") else None
    if cost is not None:
        return cost
    try:
        return calibrate(summary.result)
    except PlanError as exc:
        return str(exc)


def predict(summary: Summary) -> Prediction | str:
    """The prediction, or why there is none (no profile costs and no usable calibration)."""
    cost = prediction_cost(summary)
    if isinstance(cost, str):
        return cost
    engines = summary.result.manifest.get("engines") or {}
    block_size = int(engines.get("block_size") or LegSetup().block_size)
    measured = {row["point"]: row for row in ratio_rows(summary)}
    points: list[PointPrediction] = []
    for point in summary.result.prefix_points:
        recs = summary.result.points.get(("on", point)) or summary.result.points.get(("off", point))
        if not recs:
            continue
        reuse = [r for r in recs[0] if r.ok and r.turn >= summary.min_turn and r.turn >= 2]
        if not reuse:
            continue
        pulled = [_pulled_tokens(r, block_size) for r in reuse]
        ratios = [
            _predicted_ratio(cost, _prompt_len(r), n) for r, n in zip(reuse, pulled, strict=True)
        ]
        row = measured[point]
        points.append(
            PointPrediction(
                point,
                sum(pulled) / len(pulled),
                sum(ratios) / len(ratios),
                row["ttft_ratio"],
                row["prefill_ratio"],
            )
        )
    check = tuple(check_rows(summary.result, cost)) if cost.source == "calibration" else ()
    return Prediction(cost.source, break_even_tokens(cost), points, _crossover(points), check)


def _prompt_len(rec: RequestRecord) -> int:
    return rec.prompt_tokens or rec.input_num_tokens


def _pulled_tokens(rec: RequestRecord, block_size: int) -> int:
    """Tokens P pulls on a reuse turn: D holds the history before this turn's message.

    P's prefix cache is off in both legs (hit 0); the threshold is left out
    (``threshold=0``) so that every point shows what the pull itself costs.
    """
    history = round(max(0.0, rec.input_num_tokens * rec.approx_cached_percent / 100.0))
    decision = pull_decision(
        prompt_tokens=_prompt_len(rec),
        local_hit_tokens=0,
        remote_num_tokens=history,
        block_size=block_size,
        threshold=0,
    )
    return decision.tokens


def _predicted_ratio(cost: CostModel, length: int, pulled: int) -> float:
    off = cost.prefill_fixed_us + cost.recompute_us(length)
    on = cost.prefill_fixed_us + cost.pull_us(pulled) + cost.recompute_us(length - pulled, pulled)
    return off / on if on > 0 else math.inf


def _crossover(points: list[PointPrediction]) -> tuple[float, float] | None:
    """History tokens of the last pair of points where measured TTFT OFF/ON crosses 1."""
    crossover = None
    for below, above in itertools.pairwise(points):
        if (
            below.measured_ratio is not None
            and above.measured_ratio is not None
            and below.measured_ratio <= 1.0 < above.measured_ratio
        ):
            crossover = (below.history_tokens, above.history_tokens)
    return crossover
