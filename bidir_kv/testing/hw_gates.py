"""The hardware tier's gates, as pure functions of measured rounds (docs/hardware.md §4).

Per prompt length, OFF (recompute: P gets the miss dict) and ON (readback: P gets D's
dict) rounds are made side by side on the same prompts. Three gates:

* **speedup**: median OFF / median ON turn-2 prefill time >= a bound (given with
  ``--hw-min-speedup LEN=X``, else from this run's own calibration, :func:`calibrated_bounds`);
* **mechanism**: every ON round pulled tokens from D, the bytes moved equal the blocks
  those tokens fill × block size × KV bytes per token within 1 %, and no transfer
  failed (a read P declined as expired pulls nothing, so the first point catches it);
* **efficiency**: bytes / NIXL transfer time >= a share of ``--hw-line-rate-gbps``.

* **decode** (TPOT): D's TPOT p99 over the ON turns exceeds that over the OFF turns by at
  most ``--hw-max-tpot-regression`` percent (:func:`gate_tpot`; the same function gates a
  ``bench`` result's OFF and ON legs, ``python -m bidir_kv.tools.gate --bench DIR``).

A failing gate raises :class:`GateFailure` whose message names the length, the bound and
the measurement, so a red release run says what to look at.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bidir_kv.bench.stats import percentile
from bidir_kv.errors import CheckFailure
from bidir_kv.plan.calibrate import linear_fit
from bidir_kv.plan.planner import CostModel, PlanError, ttft_rows
from bidir_kv.policy import blocks_for_tokens

__all__ = [
    "MECHANISM_TOLERANCE",
    "GateFailure",
    "LengthResult",
    "calibrated_bounds",
    "expected_kv_bytes",
    "gate_efficiency",
    "gate_mechanism",
    "gate_speedup",
    "gate_tpot",
    "parse_bounds",
]

MECHANISM_TOLERANCE = 0.01  # bytes moved vs blocks × block bytes


class GateFailure(CheckFailure):
    """A gate did not hold; the message names length, bound and measurement."""


@dataclass
class LengthResult:
    """Every round at one history length (seconds, tokens, bytes; metric deltas on P)."""

    history_tokens: int
    prompt_tokens: int  # turn-2 prompt: history + D's answer + new tokens
    off_s: list[float] = field(default_factory=list)
    on_s: list[float] = field(default_factory=list)
    pulled_tokens: list[int] = field(default_factory=list)  # external_kv_transfer per ON
    bytes_moved: list[float] = field(default_factory=list)
    xfer_s: list[float] = field(default_factory=list)  # nixl_xfer_time_seconds_sum delta
    xfers: list[int] = field(default_factory=list)
    failed: int = 0
    expired: int = 0
    fabric: list[dict[str, int]] = field(default_factory=list)  # P's NIC counter deltas per ON
    # D's answer to each OFF and ON round, streamed: TPOT per request (s), the decode gate's
    off_tpot_s: list[float] = field(default_factory=list)
    on_tpot_s: list[float] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return statistics.median(self.off_s) / statistics.median(self.on_s)

    @property
    def gbps(self) -> float | None:
        """Achieved transfer rate in Gb/s over every ON round (None: no transfer time)."""
        t = sum(self.xfer_s)
        return sum(self.bytes_moved) * 8 / t / 1e9 if t > 0 else None

    def to_dict(self) -> dict[str, object]:
        return {
            "history_tokens": self.history_tokens,
            "prompt_tokens": self.prompt_tokens,
            "off_s": self.off_s,
            "on_s": self.on_s,
            "pulled_tokens": self.pulled_tokens,
            "bytes_moved": self.bytes_moved,
            "xfer_s": self.xfer_s,
            "xfers": self.xfers,
            "failed": self.failed,
            "expired": self.expired,
            "fabric": self.fabric,
            "off_tpot_s": self.off_tpot_s,
            "on_tpot_s": self.on_tpot_s,
            "speedup": self.speedup if self.off_s and self.on_s else None,
            "gbps": self.gbps,
        }


def parse_bounds(text: str | None) -> dict[int, float]:
    """``"4096=1.3,16384=2"`` -> {4096: 1.3, 16384: 2.0}; raises ValueError naming the item."""
    out: dict[int, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        length, sep, bound = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(length)] = float(bound)
        except ValueError:
            raise ValueError(f"expected LEN=X, got {item.strip()!r}") from None
    return out


def gate_speedup(result: LengthResult, bound: float, source: str = "given") -> float:
    """Median OFF / ON >= ``bound``; returns the speedup."""
    if not result.off_s or not result.on_s:
        raise GateFailure(f"length {result.history_tokens}: no OFF/ON rounds were measured")
    speedup = result.speedup
    if not speedup >= bound:
        raise GateFailure(
            f"length {result.history_tokens}: TTFT speedup {speedup:.3f}x (OFF median "
            f"{statistics.median(result.off_s) * 1e3:.1f} ms / ON median "
            f"{statistics.median(result.on_s) * 1e3:.1f} ms) is below the bound "
            f"{bound:.3f}x ({source})"
        )
    return speedup


def _slots(tokens: int, block_size: int) -> int:
    """Token slots of the whole blocks ``tokens`` fill: a transfer moves whole blocks."""
    return blocks_for_tokens(tokens, block_size) * block_size


def gate_mechanism(result: LengthResult, block_size: int, kv_bytes_per_token: float | None) -> None:
    """Every ON round pulled, moved the bytes those tokens take, and nothing failed.

    P's expired counter is reported, not gated: a read P declined as expired pulls 0
    tokens (gated below), and the counter also counts P's own leases that lapsed
    unread, which may belong to any earlier turn (docs/hardware.md §5)."""
    n = result.history_tokens
    if result.failed:
        raise GateFailure(
            f"length {n}: {result.failed} failed KV transfers on P during ON rounds (bound: 0)"
        )
    if not result.pulled_tokens or min(result.pulled_tokens) <= 0:
        raise GateFailure(
            f"length {n}: an ON round pulled {min(result.pulled_tokens or [0])} "
            "tokens from D (bound: > 0); D->P readback did not engage"
        )
    per_token = kv_bytes_per_token
    if per_token is None:  # unknown model shape: every round must agree with the first
        per_token = result.bytes_moved[0] / _slots(result.pulled_tokens[0], block_size)
    for tokens, moved in zip(result.pulled_tokens, result.bytes_moved, strict=True):
        expected = _slots(tokens, block_size) * per_token
        if not math.isclose(moved, expected, rel_tol=MECHANISM_TOLERANCE):
            raise GateFailure(
                f"length {n}: {moved:,.0f} bytes moved for {tokens} pulled tokens; expected "
                f"{expected:,.0f} (= {_slots(tokens, block_size)} block slots × "
                f"{per_token:,.0f} B/token) within {MECHANISM_TOLERANCE:.0%}"
            )


def expected_kv_bytes(
    result: LengthResult, block_size: int, kv_bytes_per_token: float | None
) -> float:
    """The KV bytes the ON rounds had to move: the mechanism gate's expectation (whole
    blocks of the pulled tokens × KV bytes per token), or NIXL's own count when the
    model's shape is unknown. The fabric gate asks P's NICs to have counted them."""
    if kv_bytes_per_token is None:
        return float(sum(result.bytes_moved))
    return float(sum(_slots(t, block_size) * kv_bytes_per_token for t in result.pulled_tokens))


def gate_efficiency(result: LengthResult, line_rate_gbps: float, share: float) -> float:
    """Achieved Gb/s >= ``share`` × ``line_rate_gbps``; returns the achieved rate."""
    rate = result.gbps
    bound = share * line_rate_gbps
    if rate is None or not rate >= bound:
        shown = "no transfer time recorded" if rate is None else f"{rate:.2f} Gb/s"
        raise GateFailure(
            f"length {result.history_tokens}: transfer rate {shown} is below the bound "
            f"{bound:.2f} Gb/s ({share:.0%} of {line_rate_gbps:g} Gb/s)"
        )
    return rate


def _cost_model(results: Sequence[LengthResult], kv_bytes: float) -> tuple[CostModel, float]:
    """The run's own cost lines: recompute (fixed µs + µs/token) from the OFF rounds of
    every length; the pull (µs per read + µs/token) from what the ON rounds of the lengths
    that pulled took beyond recomputing their unpulled tail (none pulled: no pull cost,
    every length predicted as recomputed)."""
    med = statistics.median  # per-length medians: a slow round or two does not tilt a line
    xs = [float(r.prompt_tokens) for r in results]
    ys = [med(r.off_s) * 1e6 for r in results]
    fixed, recompute = linear_fit(xs, ys)
    recompute = max(recompute, 1e-9)
    pulled = [r for r in results if r.pulled_tokens]  # a length that pulled nothing has no pull
    px = [float(med(r.pulled_tokens)) for r in pulled]
    py = [
        med(r.on_s) * 1e6 - fixed - recompute * (r.prompt_tokens - n)
        for r, n in zip(pulled, px, strict=True)
    ]
    overhead, per_token = linear_fit(px, py) if px else (0.0, 0.0)
    cost = CostModel(
        recompute_us_per_token=recompute,
        recompute_us_per_token_ctx=0.0,
        xfer_us_per_token=max(per_token, 0.0),
        pull_overhead_us=max(overhead, 0.0),
        kv_bytes_per_token=kv_bytes,
        source="calibration",
    )
    return cost, max(fixed, 0.0)


def calibrated_bounds(
    results: Sequence[LengthResult],
    *,
    threshold: int,
    block_size: int,
    tolerance: float,
    kv_bytes_per_token: float = 0.0,
) -> dict[int, tuple[float, float]]:
    """{length: (bound, predicted speedup)} from this run's own rounds through the planner.

    The recompute line (fixed + µs/token) is fit over the OFF rounds of *all* lengths and
    the pull line over the ON rounds (:func:`_cost_model`); the planner's
    :func:`bidir_kv.plan.planner.ttft_rows` predicts each length's speedup, and the bound is
    ``predicted × (1 - tolerance)``. A consistency gate: with three or more lengths, a
    length whose readback falls short of the run's own straight lines fails (with two,
    the lines pass through both points and only round-to-round noise is gated). An
    absolute release bound is ``--hw-min-speedup``.
    """
    if not results:
        return {}
    try:
        cost, fixed_us = _cost_model(results, kv_bytes_per_token)
    except PlanError as exc:
        raise GateFailure(f"calibration failed: {exc}") from None
    out: dict[int, tuple[float, float]] = {}
    for r in results:
        pulled = int(statistics.median(r.pulled_tokens)) if r.pulled_tokens else 0
        (row,) = ttft_rows(
            cost,
            [r.prompt_tokens],
            new_tokens=r.prompt_tokens - pulled,
            threshold=threshold,
            fixed_us=fixed_us,
            block_size=block_size,
        )
        out[r.history_tokens] = (row.ratio * (1 - tolerance), row.ratio)
    return out


def bound_for(
    length: int,
    given: Mapping[int, float],
    calibrated: Mapping[int, tuple[float, float]],
    tolerance: float,
) -> tuple[float, str]:
    """The bound for ``length`` and where it came from (for the failure message)."""
    if length in given:
        return given[length], "--hw-min-speedup"
    bound, predicted = calibrated[length]
    return bound, f"calibrated: predicted {predicted:.3f}x - {tolerance:.0%} tolerance"


def gate_tpot(
    where: str, off_tpot_s: Sequence[float], on_tpot_s: Sequence[float], max_regression: float
) -> str:
    """TPOT p99 of the ON turns at most ``max_regression`` percent above the OFF turns'
    (TPOT per request: (latency − TTFT) / (output tokens − 1), docs/benchmarking.md
    "Decode side"); ``where`` names the length or point. Returns what was compared."""
    if not off_tpot_s or not on_tpot_s:
        raise GateFailure(
            f"{where}: no TPOT to compare ({len(off_tpot_s)} OFF and {len(on_tpot_s)} ON turns "
            "decoded more than one token)"
        )
    off, on = percentile(list(off_tpot_s), 99), percentile(list(on_tpot_s), 99)
    regression = (on / off - 1.0) * 100.0 if off > 0 else math.inf
    shown = (
        f"TPOT p99 ON {on * 1e3:.2f} ms vs OFF {off * 1e3:.2f} ms ({regression:+.1f} %; "
        f"{len(on_tpot_s)} ON and {len(off_tpot_s)} OFF turns)"
    )
    if not regression <= max_regression:
        raise GateFailure(f"{where}: decode regression beyond {max_regression:g} %: {shown}")
    return shown
