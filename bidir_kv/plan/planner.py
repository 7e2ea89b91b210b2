"""The planner: when does pulling KV from D beat recomputing it, and what does the TTL cost?

Pure functions over a per-token cost model. The cost model comes either from a
model shape plus hardware figures (``CostModel.from_hardware``) or from a
measured ``bench`` run (``calibrate``). Formulas (derivation in docs/profiles.md):

* recompute ``n`` new tokens after ``c`` cached ones:
  ``n × (a + b × (c + n/2) / 1000)`` µs (``a``: matmuls, ``b``: attention per 1k context)
* pull ``n`` tokens: ``o + n × x`` µs (``o``: fixed per-pull overhead, ``x``: bytes/bandwidth)
* break-even: the smallest ``n`` with recompute(n, 0) ≥ pull(n); at context 0 the
  recompute is cheapest, so a threshold set there never pulls at a loss.
* TTL memory (Little's law): D holds each finished turn's KV for ``min(gap, TTL)``
  (released early when P reads it on the next turn) and the last turn's for the
  full TTL (D cannot know it was the last).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bidir_kv.bench.distributions import Distribution
from bidir_kv.engine.profiles import TermRange
from bidir_kv.engine.pull_model import PullModel
from bidir_kv.engine.settings import EngineSettings
from bidir_kv.errors import PlanError
from bidir_kv.plan.modelcfg import ModelShape
from bidir_kv.policy import (
    DEFAULT_DECODER_KV_BLOCKS_TTL,
    DEFAULT_RECOMPUTE_THRESHOLD,
    EXPIRY_SAFETY_MARGIN,
    blocks_for_tokens,
    pull_decision,
    read_window,
)
from bidir_kv.router.settings import RouterSettings

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "ROUTER_CACHE_TTL_S",
    "CostModel",
    "Hardware",
    "PlanError",
    "TtlRow",
    "Workload",
    "break_even_tokens",
    "recommend_threshold",
    "recommend_ttl",
    "ttft_rows",
    "ttl_rows",
]

DEFAULT_BLOCK_SIZE: int = EngineSettings.default("block_size")  # vLLM's --block-size
ROUTER_CACHE_TTL_S = RouterSettings.cache_ttl  # the router's (and upstream proxy's) default


@dataclass(frozen=True)
class Hardware:
    """Target figures. Defaults: p5en.48xlarge (8× H200, EFA); sources in docs/profiles.md."""

    gpus: int = 8  # tensor-parallel size of one engine
    peak_tflops_per_gpu: float = 989.0  # H200 dense BF16 tensor-core peak
    mfu: float = 0.40  # achievable fraction of peak during prefill (assumption)
    hbm_gbytes_per_s: float = 4800.0  # H200 HBM3e
    rail_gbytes_per_s: float = 4.4  # achieved per rank-level NIXL transfer (measured)
    rails_per_gpu: int = 1  # rails one rank's transfer uses (assumption)
    per_descriptor_us: float = 0.54  # submission cost of one small RDMA READ (measured)
    pull_overhead_us: float = 3000.0  # per pull: descriptor list, post, notify (measured)
    block_size: int = DEFAULT_BLOCK_SIZE  # the target's KV block (descriptor granularity)
    step_us: float = 1000.0  # one idle engine step of P (assumption)
    handshake_us: float = 6e6  # first pull between a new pair (measured, llm-d)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            zero_ok = name in ("per_descriptor_us", "pull_overhead_us", "step_us", "handshake_us")
            if value < 0 or (value == 0 and not zero_ok):
                raise PlanError(f"hardware figure {name} must be > 0, got {value}")
        if self.mfu > 1:
            raise PlanError("mfu is a fraction in (0, 1]")

    @property
    def flops_per_s(self) -> float:
        return self.gpus * self.peak_tflops_per_gpu * 1e12 * self.mfu

    def pull_model(self, shape: ModelShape) -> PullModel:
        """The pull terms of ``shape`` on this hardware (bidir_kv.engine.pull_model)."""
        return PullModel(
            fixed_us=self.pull_overhead_us,
            per_descriptor_us=self.per_descriptor_us,
            rank_bytes_per_token=shape.kv_bytes_per_token_per_rank(self.gpus),
            rank_gbytes_per_s=self.rail_gbytes_per_s * self.rails_per_gpu,
            block_size=self.block_size,
            descriptors_per_block=shape.num_layers * shape.kv_tensors_per_layer(),
            step_us=self.step_us,
            handshake_us=self.handshake_us,
        )


@dataclass(frozen=True)
class CostModel:
    """Per-token costs in microseconds on the target (or as measured).

    A pull of ``n`` tokens costs ``pull_fixed_us + n × pull_us_per_token``: the
    fixed part is ``pull_overhead_us`` plus half an idle step (the completion is
    seen at step granularity), the per-token part is the bytes (``xfer_us_per_token``)
    plus the descriptors (``descriptors_per_token × xfer_us_per_descriptor``).
    ``prefill_fixed_us`` is per request and common to both legs (HTTP, scheduling):
    it moves leg predictions, never the break-even. ``pull_after_us_per_token`` is
    what a calibration finds P's prefill spends per pulled token beyond the transfer
    histogram (work on the pulled blocks); derived models leave it 0.
    ``decode_ttft_*`` is D's part of TTFT (its read of P's tail and first step),
    fixed + per prompt token; it moves both legs' TTFT, never the break-even.
    """

    recompute_us_per_token: float
    recompute_us_per_token_ctx: float  # per new token per 1k context tokens
    xfer_us_per_token: float  # bytes part, per token
    pull_overhead_us: float
    kv_bytes_per_token: float  # held/moved per token over the whole TP group
    source: str = "hardware"
    notes: tuple[str, ...] = field(default=())
    xfer_us_per_descriptor: float = 0.0
    descriptors_per_token: float = 0.0  # per rank
    step_us: float = 0.0
    prefill_fixed_us: float = 0.0
    pull_after_us_per_token: float = 0.0
    sources: tuple[str, ...] = field(default=())
    # D's part of TTFT beyond P's prefill: fixed + per prompt token (a fit; derived: 0)
    decode_ttft_fixed_us: float = 0.0
    decode_ttft_us_per_token: float = 0.0
    # how far each uncertain term may be from its value (bidir_kv.plan.ranges); () = a point
    uncertainty: tuple[TermRange, ...] = field(default=())
    block_size: int = 0  # the deployment's KV block (descriptor granularity); 0 = not known

    def __post_init__(self) -> None:
        for name in (
            "recompute_us_per_token",
            "recompute_us_per_token_ctx",
            "xfer_us_per_token",
            "pull_overhead_us",
            "kv_bytes_per_token",
            "xfer_us_per_descriptor",
            "descriptors_per_token",
            "step_us",
            "prefill_fixed_us",
            "pull_after_us_per_token",
            "decode_ttft_fixed_us",
            "decode_ttft_us_per_token",
        ):
            value = getattr(self, name)
            if value < 0 or math.isnan(value):
                raise PlanError(f"{name} must be >= 0, got {value}")
        if self.recompute_us_per_token <= 0 and self.recompute_us_per_token_ctx <= 0:
            raise PlanError("recompute cost must be > 0 (both recompute terms are 0)")

    @classmethod
    def from_hardware(cls, shape: ModelShape, hw: Hardware) -> CostModel:
        pm = hw.pull_model(shape)
        kv_total = shape.kv_bytes_per_token(hw.gpus)
        notes = [
            f"{shape.name}: {shape.attention.upper()}, {shape.num_layers} layers, "
            f"{shape.active_params / 1e9:.1f}B active of {shape.total_params / 1e9:.1f}B params",
            f"KV per token: {pm.rank_bytes_per_token:,.0f} B per rank × "
            f"{hw.gpus} ranks = {kv_total:,.0f} B",
            f"prefill: {hw.gpus} GPUs × {hw.peak_tflops_per_gpu:g} TFLOP/s × MFU {hw.mfu:g}",
            f"pull per rank: {hw.pull_overhead_us:g} µs fixed + {pm.descriptors_per_block} "
            f"descriptors per {pm.block_size}-token block × {hw.per_descriptor_us:g} µs + bytes "
            f"at {pm.rank_gbytes_per_s:g} GB/s ({hw.rails_per_gpu} × {hw.rail_gbytes_per_s:g});"
            f" + half a {hw.step_us:g} µs step; first pull of a pair + {hw.handshake_us:g} µs",
        ]
        return cls(
            recompute_us_per_token=shape.linear_flops_per_token() / hw.flops_per_s * 1e6,
            recompute_us_per_token_ctx=shape.context_flops_per_token()
            * 1000
            / hw.flops_per_s
            * 1e6,
            xfer_us_per_token=pm.rank_bytes_per_token / (pm.rank_gbytes_per_s * 1e3),
            pull_overhead_us=pm.fixed_us,
            kv_bytes_per_token=kv_total,
            source="hardware",
            notes=tuple(notes),
            xfer_us_per_descriptor=pm.per_descriptor_us,
            descriptors_per_token=pm.descriptors_per_block / pm.block_size,
            step_us=pm.step_us,
            block_size=pm.block_size,
        )

    @property
    def pull_fixed_us(self) -> float:
        return self.pull_overhead_us + self.step_us / 2

    @property
    def pull_us_per_token(self) -> float:
        return (
            self.xfer_us_per_token
            + self.descriptors_per_token * self.xfer_us_per_descriptor
            + self.pull_after_us_per_token
        )

    def recompute_us(self, new_tokens: float, context_tokens: float = 0.0) -> float:
        if new_tokens <= 0:
            return 0.0
        avg_ctx = context_tokens + new_tokens / 2
        return new_tokens * (
            self.recompute_us_per_token + self.recompute_us_per_token_ctx * avg_ctx / 1000
        )

    def pull_us(self, tokens: float) -> float:
        return 0.0 if tokens <= 0 else self.pull_fixed_us + tokens * self.pull_us_per_token

    def decode_ttft_us(self, prompt_tokens: float) -> float:
        """D's part of TTFT for a prompt of ``prompt_tokens`` (0 when not modelled)."""
        return self.decode_ttft_fixed_us + self.decode_ttft_us_per_token * max(0.0, prompt_tokens)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["notes"] = list(self.notes)
        d["sources"] = list(self.sources)
        d["uncertainty"] = [asdict(t) for t in self.uncertainty]
        return d


def break_even_tokens(cost: CostModel, context_tokens: float = 0.0) -> float:
    """Smallest real ``n`` with recompute(n, context) ≥ pull(n); ``inf`` if never."""
    q = cost.recompute_us_per_token_ctx / 2000
    lin = (
        cost.recompute_us_per_token
        + cost.recompute_us_per_token_ctx * context_tokens / 1000
        - cost.pull_us_per_token
    )
    o = cost.pull_fixed_us
    if q == 0:
        if lin <= 0:
            return math.inf
        return o / lin
    # q n² + lin n − o = 0, positive root, in the form without cancellation
    disc = math.sqrt(lin * lin + 4 * q * o)
    if lin > 0:
        return 2 * o / (lin + disc)
    return (disc - lin) / (2 * q)


def recommend_threshold(
    cost: CostModel, block_size: int = DEFAULT_BLOCK_SIZE
) -> tuple[int | None, str]:
    """A ``kv_recompute_threshold`` and the reasoning. ``None`` = leave the feature off."""
    n = break_even_tokens(cost)
    if math.isinf(n):
        return None, (
            "pulling never pays: per-token transfer "
            f"({cost.pull_us_per_token:.2f} µs) is not cheaper than recompute — keep "
            "bidirectional_kv_xfer off, or make pulls cheaper (bandwidth, fewer descriptors)"
        )
    exact = max(1, math.ceil(n))
    rounded = blocks_for_tokens(exact, block_size) * block_size
    parts = (
        f" (bytes {cost.xfer_us_per_token:.3f}, descriptors "
        f"{cost.descriptors_per_token * cost.xfer_us_per_descriptor:.3f}, P's work around the "
        f"READ {cost.pull_after_us_per_token:.3f})"
        if cost.pull_after_us_per_token
        else ""
    )
    why = (
        f"from the {cost.source} terms, pull pays from {n:.1f} tokens: a pull costs "
        f"{cost.pull_fixed_us:.0f} µs fixed + {cost.pull_us_per_token:.3f} µs/token{parts}, "
        f"recompute costs "
        f"{cost.recompute_us_per_token:.3f} µs/token (+{cost.recompute_us_per_token_ctx:.3f} "
        f"µs/token per 1k context) — break-even at context 0 (the cheapest recompute), "
        f"rounded up to a whole block of {block_size}; vLLM's default is "
        f"{DEFAULT_RECOMPUTE_THRESHOLD}"
    )
    return rounded, why


@dataclass(frozen=True)
class TtftRow:
    prompt_tokens: int
    history_tokens: int
    off_ms: float
    on_ms: float
    saving_ms: float
    ratio: float
    pulls: bool


def ttft_rows(
    cost: CostModel,
    prompt_lengths: Sequence[int],
    new_tokens: int,
    threshold: int,
    fixed_us: float = 0.0,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> list[TtftRow]:
    """Predicted TTFT per prompt length with P's prefix cache off (the blog's setting).

    OFF recomputes the whole prompt; ON asks :func:`~bidir_kv.policy.pull_decision`
    whether P pulls the history (D holds all but the ``new_tokens`` tail; P's own
    hit is 0) and computes the rest. Both legs add the cost model's per-request
    prefill part and D's part of TTFT, and ``fixed_us`` (anything else common, e.g.
    HTTP) on top.
    """
    rows = []
    for length in prompt_lengths:
        if length <= 0:
            raise PlanError(f"prompt length must be > 0, got {length}")
        history = max(0, length - new_tokens)
        # both legs: the per-request prefill part and D's part of TTFT
        fixed = fixed_us + cost.prefill_fixed_us + cost.decode_ttft_us(length)
        off = cost.recompute_us(length) + fixed
        decision = pull_decision(
            prompt_tokens=length,
            local_hit_tokens=0,
            remote_num_tokens=history,
            block_size=block_size,
            threshold=threshold,
        )
        pulls = decision.pull
        if pulls:
            pulled = decision.tokens
            on = cost.pull_us(pulled) + cost.recompute_us(length - pulled, pulled) + fixed
        else:
            on = off
        rows.append(
            TtftRow(
                prompt_tokens=length,
                history_tokens=history,
                off_ms=off / 1e3,
                on_ms=on / 1e3,
                saving_ms=(off - on) / 1e3,
                ratio=off / on if on > 0 else math.inf,
                pulls=pulls,
            )
        )
    return rows


@dataclass(frozen=True)
class Workload:
    """Conversation traffic seen by one D instance."""

    conversations_per_s: float
    turns: int
    first_prompt_tokens: int
    tokens_per_turn: int  # user input + answer added per turn
    output_tokens: int
    gap: Distribution

    def __post_init__(self) -> None:
        if self.conversations_per_s <= 0:
            raise PlanError("conversation rate must be > 0")
        if self.turns < 1:
            raise PlanError("turns must be >= 1")

    def held_tokens(self, turn: int) -> int:
        """Tokens D retains after 1-based ``turn``: prompt + answer − 1 (docs/protocol.md §3.6)."""
        return self.first_prompt_tokens + (turn - 1) * self.tokens_per_turn + self.output_tokens - 1


@dataclass(frozen=True)
class TtlRow:
    ttl_s: float
    miss_fraction: float  # P(gap > TTL − decline margin): the next turn recomputes
    held_tokens: float
    held_gib: float
    held_gib_per_gpu: float


def ttl_rows(cost: CostModel, work: Workload, ttls: Sequence[float], gpus: int = 8) -> list[TtlRow]:
    rows = []
    for ttl in ttls:
        if ttl <= 0:
            raise PlanError(f"TTL must be > 0, got {ttl}")
        usable = read_window(ttl)
        miss = 1.0 - work.gap.cdf(usable) if work.turns > 1 else 0.0
        mean_hold = work.gap.mean_truncated(ttl)
        tokens_s = sum(work.held_tokens(t) for t in range(1, work.turns)) * mean_hold
        tokens_s += work.held_tokens(work.turns) * ttl
        held = work.conversations_per_s * tokens_s
        gib = held * cost.kv_bytes_per_token / 2**30
        rows.append(TtlRow(ttl, miss, held, gib, gib / gpus))
    return rows


def recommend_ttl(
    rows: Sequence[TtlRow], miss_target: float, kv_budget_gib: float | None = None
) -> tuple[TtlRow, str]:
    """Smallest TTL meeting the miss target within the memory budget, with the reason."""
    ordered = sorted(rows, key=lambda r: r.ttl_s)
    if not ordered:
        raise PlanError("no TTL candidates")
    fits = [r for r in ordered if kv_budget_gib is None or r.held_gib <= kv_budget_gib]
    meeting = [r for r in fits if r.miss_fraction <= miss_target]
    if meeting:
        best = meeting[0]
        why = (
            f"the smallest TTL whose expiry miss rate ({best.miss_fraction:.1%}) meets the "
            f"target {miss_target:.0%}; longer TTLs hold more memory for little gain"
        )
    elif fits:
        best = fits[-1]
        why = (
            f"no TTL within the memory budget meets the miss target {miss_target:.0%}; the "
            f"largest one that fits misses {best.miss_fraction:.1%} of follow-up turns"
        )
    else:
        best = ordered[0]
        why = "even the smallest TTL exceeds the KV memory budget; add D capacity"
    why += (
        f". Keep the router's cache TTL below it (the upstream proxy uses "
        f"{ROUTER_CACHE_TTL_S:g} s under "
        f"vLLM's default {DEFAULT_DECODER_KV_BLOCKS_TTL:g} s) and remember P declines reads "
        f"within {EXPIRY_SAFETY_MARGIN:g} s of expiry"
    )
    return best, why
