"""Ranges, not points: what the planner's answers become when its terms are uncertain.

A cost model may carry an uncertainty per term (:class:`~bidir_kv.engine.profiles.TermRange`:
a low and a high multiplier and the source of the spread, docs/profiles.md §5). Every
answer is evaluated at each corner of the box the ranges span (each term at its low or
its high end, 2^k models for k uncertain terms), so a range is the least and the most
any combination gives; the *dominant* term is the one whose own swing (the others at
their values) moves the answer most. A recommended ``kv_recompute_threshold`` *holds
across the range* when pulling pays from it at every corner.

Pure functions over :class:`~bidir_kv.plan.planner.CostModel`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from bidir_kv.plan.planner import (
    DEFAULT_BLOCK_SIZE,
    CostModel,
    PlanError,
    break_even_tokens,
    ttft_rows,
)
from bidir_kv.policy import below_threshold, blocks_for_tokens

__all__ = [
    "RowSpread",
    "Spread",
    "ThresholdCheck",
    "break_even_spread",
    "corners",
    "scaled",
    "spread",
    "threshold_check",
    "ttft_spreads",
]


def scaled(cost: CostModel, term: str, factor: float) -> CostModel:
    """``cost`` with one uncertain term multiplied by ``factor``."""
    if factor <= 0:
        raise PlanError(f"a term's factor must be > 0, got {factor}")
    f = factor
    if term == "recompute":
        return replace(
            cost,
            recompute_us_per_token=cost.recompute_us_per_token * f,
            recompute_us_per_token_ctx=cost.recompute_us_per_token_ctx * f,
        )
    if term == "pull":
        return replace(
            cost,
            xfer_us_per_token=cost.xfer_us_per_token * f,
            xfer_us_per_descriptor=cost.xfer_us_per_descriptor * f,
        )
    if term == "pull_fixed":
        return replace(cost, pull_overhead_us=cost.pull_overhead_us * f)
    if term == "pull_after":
        return replace(cost, pull_after_us_per_token=cost.pull_after_us_per_token * f)
    if term == "prefill_fixed":
        return replace(cost, prefill_fixed_us=cost.prefill_fixed_us * f)
    if term == "decode_part":
        return replace(
            cost,
            decode_ttft_fixed_us=cost.decode_ttft_fixed_us * f,
            decode_ttft_us_per_token=cost.decode_ttft_us_per_token * f,
        )
    raise PlanError(f"no cost term {term!r} to scale")


def corners(cost: CostModel) -> list[tuple[dict[str, float], CostModel]]:
    """Every combination of the uncertain terms at their low or high end."""
    terms = cost.uncertainty
    out = []
    for ends in itertools.product(*[(t.low, t.high) for t in terms]):
        model = cost
        for t, factor in zip(terms, ends, strict=True):
            model = scaled(model, t.term, factor)
        out.append(({t.term: f for t, f in zip(terms, ends, strict=True)}, model))
    return out


@dataclass(frozen=True)
class Spread:
    """One answer at the terms' values (``center``) and over the box of their ranges."""

    center: float
    low: float
    high: float
    dominant: str | None  # the term whose own swing is the largest (None: no ranges)
    swings: dict[str, float]  # |answer at the term's high - at its low|, the others at value

    @property
    def point(self) -> bool:
        return self.dominant is None


def _swing(a: float, b: float) -> float:
    if math.isinf(a) or math.isinf(b):
        return 0.0 if a == b else math.inf
    return abs(a - b)


def spread(cost: CostModel, answer: Callable[[CostModel], float]) -> Spread:
    """``answer`` at the center, its least and most over the corners, and its dominant term."""
    center = answer(cost)
    if not cost.uncertainty:
        return Spread(center, center, center, None, {})
    values = [answer(model) for _, model in corners(cost)] + [center]
    swings = {
        t.term: _swing(answer(scaled(cost, t.term, t.high)), answer(scaled(cost, t.term, t.low)))
        for t in cost.uncertainty
    }
    dominant = max(swings, key=lambda k: swings[k])
    return Spread(center, min(values), max(values), dominant, swings)


def break_even_spread(cost: CostModel) -> Spread:
    return spread(cost, break_even_tokens)


@dataclass(frozen=True)
class RowSpread:
    """One prompt length's TTFT OFF, ON and OFF/ON over the ranges, ms."""

    prompt_tokens: int
    off_ms: Spread
    on_ms: Spread
    ratio: Spread


def ttft_spreads(
    cost: CostModel,
    prompt_lengths: Sequence[int],
    new_tokens: int,
    threshold: int,
    fixed_us: float = 0.0,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> list[RowSpread]:
    """Per prompt length, the TTFT rows of :func:`~bidir_kv.plan.planner.ttft_rows` over
    the ranges, with one threshold for every corner (the one the user sets)."""
    out = []
    for length in prompt_lengths:
        parts = [_RowPart(length, new_tokens, threshold, fixed_us, block_size, i) for i in range(3)]
        out.append(RowSpread(length, *(spread(cost, part) for part in parts)))
    return out


@dataclass(frozen=True)
class _RowPart:
    """One figure of a TTFT row (0: OFF ms, 1: ON ms, 2: OFF/ON) as a function of the model."""

    length: int
    new_tokens: int
    threshold: int
    fixed_us: float
    block_size: int
    index: int

    def __call__(self, model: CostModel) -> float:
        r = ttft_rows(
            model, [self.length], self.new_tokens, self.threshold, self.fixed_us, self.block_size
        )[0]
        return (r.off_ms, r.on_ms, r.ratio)[self.index]


@dataclass(frozen=True)
class ThresholdCheck:
    """Whether a threshold pays at every corner, and the one that would."""

    threshold: int | None
    holds: bool
    robust_threshold: int | None  # the smallest whole-block threshold that holds (None: none)
    text: str


def threshold_check(
    cost: CostModel, threshold: int | None, block_size: int = DEFAULT_BLOCK_SIZE
) -> ThresholdCheck:
    """Does ``threshold`` (None: the feature left off) hold across the ranges?

    It holds when, at every corner, every pull the threshold rule takes
    (:func:`~bidir_kv.policy.below_threshold`) costs no more than recomputing it: the
    largest pull that loses at the worst corner is one the rule refuses. Leaving the
    feature off holds when pulling pays at no corner.
    """
    be = break_even_spread(cost)
    worst = be.high
    ends = _worst_corner(cost, be)
    robust = None if math.isinf(worst) else blocks_for_tokens(math.ceil(worst), block_size)
    if robust is not None:
        robust *= block_size
    why = f"break-even {_tokens(be.low)}-{_tokens(be.high)} tokens over the ranges" + (
        f" (dominant term: {be.dominant})" if be.dominant else ""
    )
    if threshold is None:
        holds = math.isinf(be.low)
        text = (
            f"keeping the feature off holds across the range: {why}"
            if holds
            else f"keeping the feature off does not hold across the range: {why}; at some "
            f"corner pulls pay from {_tokens(be.low)} tokens"
        )
        return ThresholdCheck(None, holds, robust, text)
    # the largest pull that loses at the worst corner must be one the rule refuses
    losing = math.inf if math.isinf(worst) else math.ceil(worst) - 1
    holds = losing < 1 or (not math.isinf(losing) and below_threshold(int(losing), threshold))
    if be.point:
        text = f"no ranges recorded for these terms: a point estimate ({why})"
    elif holds:
        text = f"holds across the range: {why}, all at or below {threshold}"
    elif robust is None:
        text = f"does not hold across the range: {why}; at {ends} pulls never pay"
    else:
        text = (
            f"does not hold across the range: {why}; at {ends} pulls pay only from "
            f"{_tokens(worst)} tokens — a threshold of {robust} holds across the range"
        )
    return ThresholdCheck(threshold, holds, robust, text)


def _worst_corner(cost: CostModel, be: Spread) -> str:
    """The corner with the highest break-even, as ``term xF, ...`` (the terms that move it)."""
    if not cost.uncertainty:
        return "the values"
    ends, _ = max(corners(cost), key=lambda c: break_even_tokens(c[1]))
    moving = [f"{term} x{f:g}" for term, f in ends.items() if be.swings.get(term)]
    return ", ".join(moving) or "the values"


def _tokens(n: float) -> str:
    return "never" if math.isinf(n) else f"{n:,.0f}"
