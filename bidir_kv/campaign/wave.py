"""The D-full wave: what a memory-growth wave of retained turns costs new and old users.

A wave of big turns, each a conversation nobody continues, is retained on D beyond its
KV capacity. Around it the campaign's client sends (at most one continuing turn at a
time, so each hit or discard counted belongs to one turn):

* **probes**: the first turn of a *new* conversation, streamed, before the wave (the
  baseline), together with each big turn (sent at the same moment), and after the
  wave. Their time to first token is what a new user waits: with stock vLLM a probe
  D cannot admit waits until a retained turn's TTL frees blocks; with our fence D
  releases retained turns early instead.
* **continuing turns**: ``continuing`` conversations opened before the wave take one
  more turn with each big turn (round robin) and once more after the wave. Each is a hit when
  P took D's history and kept it: the router counted a hit and P discarded no read for
  a changed fence word. A miss is a turn P recomputed, e.g. because its KV was released
  early: the price of releasing.

D's releases are counted by reason across the wave: ``budget`` and ``pressure`` (early,
fenced turns) and ``ttl`` (at ``decoder_kv_blocks_ttl``), from the emulator's series or,
on vLLM, from the connector's and vLLM's log lines (its counts are not Prometheus series,
docs/connector.md §5.4). ``bidir-kv campaign --faults d-full`` runs it on one deployment;
``bidir-kv campaign wave`` runs it on several side by side (docs/campaign.md).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bidir_kv.campaign.client import Clients, Conversation, TurnOutcome
from bidir_kv.campaign.deploy import Deployment
from bidir_kv.client import ClientError, scrape

__all__ = [
    "REASONS",
    "WavePlan",
    "WaveResult",
    "count_log_lines",
    "counted_hits",
    "percentile",
    "run_wave",
]

HITS = "bidir_kv_router_cache_hits_total"
P_READS = "vllm:nixl_xfer_time_seconds_count"  # READs P made (hits, whatever worker routed)
RELEASED = "bidir_kv:retained_released_early_reqs_total"  # the emulator's, by reason
DISCARDED = "bidir_kv:fence_discarded_reads_total"  # the emulator's P
REASONS = ("budget", "pressure", "ttl")
# log lines, one per event: the connector's (bidir_kv/connector/nixl.py, worker.py) and
# the TTL release both vLLM and the emulator log
LOG_LINES = {
    "budget": "before its TTL (over the retention budget",
    "pressure": "before its TTL (a request is waiting for KV blocks",
    "ttl": "Releasing expired KV blocks for request",
    "discard": "bidir-kv: fence: engine",
}


@dataclass(frozen=True)
class WavePlan:
    """The wave and the requests around it (defaults: the emulator's 262,144-token D)."""

    big_turns: int = 10
    big_tokens: int = 30_000
    big_gen: int = 4
    continuing: int = 4  # conversations opened before the wave that go on through it
    probe_tokens: int = 160  # a new conversation's first turn (above the threshold)
    new_tokens: int = 24  # what a continuing turn adds
    gen: int = 8
    baseline: int = 3  # probes before the wave
    after: int = 3  # probes after it
    # a probe "waited" when its TTFT exceeds max(wait_floor, wait_factor x the
    # baseline's p90): a memory wait is a TTL (tens of seconds), ordinary queueing is not
    wait_factor: float = 5.0
    wait_floor: float = 1.0


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in (0, 1]); ``None`` for no values."""
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class WaveResult:
    plan: WavePlan
    baseline: list[TurnOutcome] = field(default_factory=list)  # probes before the wave
    probes: list[TurnOutcome] = field(default_factory=list)  # during and after it
    big: list[TurnOutcome] = field(default_factory=list)
    continued: list[tuple[TurnOutcome, bool]] = field(default_factory=list)  # (turn, hit)
    releases: dict[str, float] | None = None  # by reason; None: D does not say
    seconds: float = 0.0

    @staticmethod
    def first_token(t: TurnOutcome) -> float | None:
        """When the client had the first token: the first chunk with text, or for an
        answer none of whose chunks had text (a greedy tiny model may generate only
        tokens that decode to nothing), its end; ``None`` when not answered."""
        if not t.ok:
            return None
        return t.ttft if t.ttft is not None else t.elapsed

    def ttfts(self) -> list[float]:
        """TTFT of every probe during and after the wave that was answered."""
        return [x for t in self.probes if (x := self.first_token(t)) is not None]

    def ttft(self, q: float) -> float | None:
        return percentile(self.ttfts(), q)

    @property
    def baseline_p90(self) -> float | None:
        return percentile([x for t in self.baseline if (x := self.first_token(t)) is not None], 0.9)

    @property
    def wait_threshold(self) -> float:
        base = self.baseline_p90
        return max(self.plan.wait_floor, self.plan.wait_factor * base if base else 0.0)

    @property
    def waited(self) -> int:
        """Answered probes whose first token came later than :attr:`wait_threshold`."""
        return sum(1 for x in self.ttfts() if x > self.wait_threshold)

    @property
    def failed(self) -> int:
        """Probes with no answer or a non-2xx answer."""
        return sum(1 for t in self.probes if not t.ok)

    @property
    def hits(self) -> int:
        return sum(1 for _, hit in self.continued if hit)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / len(self.continued) if self.continued else None

    @property
    def recomputed(self) -> int:
        """Continuing turns answered without D's history (P computed it)."""
        return sum(1 for t, hit in self.continued if t.ok and not hit)

    @property
    def wrong(self) -> int | None:
        """Continuing turns the oracle found wrong; ``None`` when none was checked."""
        checked = [t.correct for t, _ in self.continued if t.correct is not None]
        return sum(1 for c in checked if not c) if checked else None

    def turns(self) -> list[TurnOutcome]:
        return [*self.big, *self.probes, *(t for t, _ in self.continued)]

    @property
    def answered(self) -> int:
        return sum(1 for t in self.turns() if t.ok)

    @property
    def all_answered(self) -> bool:
        return self.answered == len(self.turns())


# ---- what D and P say ----------------------------------------------------------------


def count_log_lines(paths: Sequence[str], needle: str) -> int:
    """Lines containing ``needle`` in the files (a missing file counts none)."""
    n = 0
    for path in paths:
        try:
            with Path(path).open(errors="replace") as f:
                n += sum(1 for line in f if needle in line)
        except OSError:
            continue
    return n


def counted_hits(dep: Deployment) -> float:
    """Counted hits: the router's, or P's READs when several workers each answer a
    scrape for themselves only."""
    if dep.router_workers > 1:
        return sum(scrape(u).value(P_READS) for u in dep.prefill_urls)
    return scrape(dep.router_url, names=[HITS]).value(HITS)


def _discards(dep: Deployment) -> float:
    """P's reads discarded for a changed fence word (emulator: its series; vLLM: the
    connector's log line)."""
    if dep.logs_count:
        return count_log_lines(dep.prefill_logs, LOG_LINES["discard"])
    return sum(scrape(u, names=[DISCARDED]).value(DISCARDED) for u in dep.prefill_urls)


def _releases(dep: Deployment) -> dict[str, float] | None:
    """D's releases so far by reason; ``None`` when D exports no such count."""
    out = {"ttl": float(count_log_lines(dep.decode_logs, LOG_LINES["ttl"]))}
    if dep.logs_count:
        for reason in ("budget", "pressure"):
            out[reason] = count_log_lines(dep.decode_logs, LOG_LINES[reason])
        return out
    try:
        snaps = [scrape(u, names=[RELEASED]) for u in dep.decode_urls]
    except ClientError:
        return None
    if not any(RELEASED in s.names() for s in snaps):
        return None
    for reason in ("budget", "pressure"):
        out[reason] = sum(s.value(RELEASED, reason=reason) for s in snaps)
    if not dep.decode_logs:
        del out["ttl"]
    return out


def _delta(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {k: after[k] - before[k] for k in REASONS if k in before and k in after}


# ---- the wave ------------------------------------------------------------------------


async def run_wave(dep: Deployment, clients: Clients, plan: WavePlan, tag: str) -> WaveResult:
    """Run the wave once through the router (see the module's docstring)."""
    url, ref = dep.router_url, dep.reference_url
    stamp = time.time_ns()
    serial = iter(range(1_000_000))

    def conv(kind: str) -> Conversation:
        n = next(serial)
        return Conversation(f"wave-{tag}-{kind}-{n}-{stamp}", random.Random(f"{tag}-{kind}-{n}"))

    async def probe() -> TurnOutcome:  # answers are not the question here: no oracle
        return await conv("new").turn(clients, url, None, plan.probe_tokens, plan.gen)

    async def none() -> None:
        return None

    async def go_on(c: Conversation | None) -> tuple[TurnOutcome, bool] | None:
        """One continuing turn, concurrent with nothing else that can hit or discard."""
        if c is None:
            return None
        h0, d0 = counted_hits(dep), _discards(dep)
        t = await c.turn(clients, url, ref, plan.new_tokens, plan.gen)
        return t, t.ok and counted_hits(dep) > h0 and _discards(dep) == d0

    res = WaveResult(plan)
    t0 = time.perf_counter()
    keep = [conv("keep") for _ in range(plan.continuing)]
    for c in keep:  # opened before the wave; retained on D like any turn
        await c.turn(clients, url, ref, plan.probe_tokens, plan.gen)
    res.baseline = [await probe() for _ in range(plan.baseline)]
    before = _releases(dep)
    for i in range(plan.big_turns):
        # a big turn, a new conversation and a continuing one arrive together: the new
        # one meets D as the wave leaves it (full, once the wave exceeds it)
        going_on = keep[i % len(keep)] if keep else None
        h0, d0 = counted_hits(dep), _discards(dep)
        big, new, cont = await asyncio.gather(
            conv("big").turn(clients, url, None, plan.big_tokens, plan.big_gen),
            probe(),
            going_on.turn(clients, url, ref, plan.new_tokens, plan.gen) if going_on else none(),
        )
        res.big.append(big)
        res.probes.append(new)
        if cont is not None:  # only a continuing turn can hit or be discarded
            res.continued.append(
                (cont, cont.ok and counted_hits(dep) > h0 and _discards(dep) == d0)
            )
    for c in keep:
        cont_after = await go_on(c)
        if cont_after is not None:
            res.continued.append(cont_after)
    res.probes += [await probe() for _ in range(plan.after)]
    res.releases = _delta(before, _releases(dep))
    res.seconds = time.perf_counter() - t0
    return res
