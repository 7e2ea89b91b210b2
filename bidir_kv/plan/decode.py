"""What retention costs the decode side, for ``plan``'s TTL and threshold advice.

D's KV pool holds two things: the running batch (every decoding request's context,
growing a block at a time) and the turns it retains for P's next read. The TTL table
(:func:`bidir_kv.plan.planner.ttl_rows`) gives the retained GiB by Little's law; this
module sets them beside D's pool:

* **the running batch** takes ``concurrency`` contexts of the workload's mean length
  during decode (Little's law again: requests in decode × their mean context); a named
  input, ``--decode-concurrency``, since the planner does not simulate the scheduler;
* **what is left** for retention is the pool less the running batch; a TTL whose retained
  GiB exceed it overflows the pool, and then D preempts running requests (vLLM V1's
  recompute preemption) or, on a stock vLLM D that pins retained blocks, new requests
  wait for them: the TPOT and TTFT cost measured by ``bench`` (docs/benchmarking.md
  "Decode side"). The advice is the largest share retained turns may hold, as
  ``bidir_kv_retention_budget`` (docs/connector.md §5.3);
* **decode step time** at that concurrency from the emulator profile's two terms
  (``decode_us_per_step + decode_us_per_seq × (batch − 1)``, docs/profiles.md §1), when
  the cost source is a profile; retention does not change it while the pool does not
  overflow (retained blocks are not read by the decode steps);
* **a pull's share of D's memory bandwidth**: P's READ of D's retained blocks reads them
  from D's memory once; at ``hbm_gbytes_per_s`` per rank that is
  ``bytes per rank / bandwidth`` of D's memory time, against a decode step. Named
  assumption: the READ and the step share D's memory bandwidth, nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bidir_kv.engine.profiles import CostProfile
from bidir_kv.plan.planner import CostModel, PlanError, TtlRow, Workload

__all__ = [
    "DEFAULT_HBM_GBYTES_PER_S",
    "DecodeSide",
    "RetentionRoom",
    "decode_step_ms",
    "pull_hbm_ms",
    "retention_room",
    "running_gib",
]

# H200 HBM3e per GPU (NVIDIA H200 datasheet: 4.8 TB/s), the p5en profiles' hardware
DEFAULT_HBM_GBYTES_PER_S = 4800.0


@dataclass(frozen=True)
class DecodeSide:
    """D as the decode-side terms see it: its KV pool for one instance (whole TP group),
    the requests decoding on it at once, its ranks and their memory bandwidth."""

    kv_gib: float
    concurrency: int
    ranks: int = 8
    hbm_gbytes_per_s: float = DEFAULT_HBM_GBYTES_PER_S

    def __post_init__(self) -> None:
        if self.kv_gib <= 0:
            raise PlanError(f"D's KV pool must be > 0 GiB, got {self.kv_gib}")
        if self.concurrency < 1:
            raise PlanError(f"decode concurrency must be >= 1, got {self.concurrency}")
        if self.ranks < 1 or self.hbm_gbytes_per_s <= 0:
            raise PlanError("ranks must be >= 1 and the memory bandwidth > 0")


def mean_decode_context(work: Workload) -> float:
    """Mean tokens in a decoding request's context over the conversation's turns: its
    prompt plus half its answer."""
    prompts = [
        work.first_prompt_tokens + (t - 1) * work.tokens_per_turn for t in range(1, work.turns + 1)
    ]
    return sum(prompts) / len(prompts) + work.output_tokens / 2


def running_gib(cost: CostModel, work: Workload, side: DecodeSide) -> float:
    """KV the running batch holds: ``concurrency`` mean decoding contexts."""
    return side.concurrency * mean_decode_context(work) * cost.kv_bytes_per_token / 2**30


@dataclass(frozen=True)
class RetentionRoom:
    """The pool split: the running batch, what is left for retained turns, and per TTL
    whether its retention fits beside the batch."""

    pool_gib: float
    running_gib: float
    room_gib: float  # pool − running batch (0 when the batch alone fills the pool)
    budget_share: float  # room / pool: the largest bidir_kv_retention_budget that fits
    overflows: dict[float, bool]  # TTL -> retained GiB exceed the room
    share_of_pool: dict[float, float]  # TTL -> retained GiB / pool

    def recommend(self, ttl: TtlRow) -> str:
        if self.room_gib <= 0:
            return (
                f"the running batch alone ({self.running_gib:.1f} GiB) fills D's "
                f"{self.pool_gib:.1f} GiB: retention of any TTL preempts decodes; add D capacity"
            )
        if self.overflows.get(ttl.ttl_s):
            return (
                f"at TTL {ttl.ttl_s:g} s retained turns ({ttl.held_gib:.1f} GiB) do not fit "
                f"beside the running batch ({self.running_gib:.1f} GiB of {self.pool_gib:.1f}): "
                "D would preempt decodes (TPOT) or, pinned, make new requests wait (TTFT); set "
                f"bidir_kv_retention_budget to {self.budget_share:.2f} or shorten the TTL"
            )
        return (
            f"at TTL {ttl.ttl_s:g} s retained turns take {self.share_of_pool[ttl.ttl_s]:.0%} of "
            f"D's pool beside a {self.running_gib:.1f} GiB running batch: no preemption expected; "
            f"a bidir_kv_retention_budget of {self.budget_share:.2f} keeps it so under bursts"
        )


def retention_room(
    cost: CostModel, work: Workload, side: DecodeSide, rows: Sequence[TtlRow]
) -> RetentionRoom:
    run = running_gib(cost, work, side)
    room = max(0.0, side.kv_gib - run)
    return RetentionRoom(
        pool_gib=side.kv_gib,
        running_gib=run,
        room_gib=room,
        budget_share=round(room / side.kv_gib, 2),
        overflows={r.ttl_s: r.held_gib > room for r in rows},
        share_of_pool={r.ttl_s: r.held_gib / side.kv_gib for r in rows},
    )


def decode_step_ms(profile: CostProfile, concurrency: int) -> float:
    """The profile's decode step (TPOT at a steady batch of ``concurrency``), ms."""
    return profile.decode_step_seconds(concurrency) * 1e3 / profile.time_scale


def pull_hbm_ms(cost: CostModel, tokens: int, side: DecodeSide) -> float:
    """D's memory time one pull of ``tokens`` takes per rank, ms (the READ reads each
    retained byte once; ranks read in parallel)."""
    per_rank = tokens * cost.kv_bytes_per_token / side.ranks
    return per_rank / (side.hbm_gbytes_per_s * 1e9) * 1e3
