"""The load campaign: N conversations x T turns at once, every answer checked by the oracle.

All conversations run concurrently, turn after turn; the router's own counters give
the hit rate on turns >= 2 (hits are counted only when P took D's tokens), the
client's clock gives p50/p99 per turn, /proc the router's resident memory.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from bidir_kv.campaign.client import Clients, Conversation, TurnOutcome
from bidir_kv.campaign.deploy import Deployment
from bidir_kv.client import ClientError, scrape

__all__ = ["LoadPlan", "LoadResult", "run_load"]

HITS = "bidir_kv_router_cache_hits_total"
PULLS = "vllm:nixl_xfer_time_seconds_count"  # READs a node made (P's: D's history pulled)


@dataclass(frozen=True)
class LoadPlan:
    conversations: int = 256
    turns: int = 10
    opening: tuple[int, int] = (80, 200)  # tokens of the first turn (above the threshold)
    new: tuple[int, int] = (8, 40)  # tokens the user adds per later turn
    gen: tuple[int, int] = (4, 16)  # tokens generated per turn
    seed: int = 0


@dataclass
class LoadResult:
    plan: LoadPlan
    turns: list[TurnOutcome] = field(default_factory=list)
    hits: float | None = None  # the router's counter (one process: its whole count)
    pulls: float | None = None  # READs the P nodes made, from their own metrics
    router_rss: int | None = None
    seconds: float = 0.0

    @property
    def failed(self) -> int:
        return sum(1 for t in self.turns if not t.ok)

    @property
    def wrong(self) -> int | None:
        checked = [t.correct for t in self.turns if t.correct is not None]
        if not checked and self.turns:
            return None
        return sum(1 for c in checked if not c)

    @property
    def later_turns(self) -> int:
        return sum(1 for t in self.turns if t.index > 0)

    @property
    def hit_rate(self) -> float | None:
        """Router-counted hits per turn >= 2; P's READs when the router count is partial."""
        count = self.hits if self.hits is not None else self.pulls
        if count is None or not self.later_turns:
            return None
        return count / self.later_turns

    @property
    def pull_rate(self) -> float | None:
        if self.pulls is None or not self.later_turns:
            return None
        return self.pulls / self.later_turns

    def latency(self, q: float) -> float:
        xs = sorted(t.elapsed for t in self.turns)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    def holds(self, min_hit_rate: float) -> bool:
        rate = self.hit_rate
        return self.failed == 0 and not self.wrong and (rate is None or rate >= min_hit_rate)


def _value(url: str, name: str) -> float | None:
    try:
        return scrape(url).value(name)
    except ClientError:
        return None


def _delta(before: list[float | None], after: list[float | None]) -> float | None:
    total = 0.0
    for a, b in zip(after, before, strict=True):
        if a is None or b is None:
            return None
        total += a - b
    return total


async def _drive(dep: Deployment, plan: LoadPlan, tag: str) -> list[TurnOutcome]:
    rng = random.Random(plan.seed)
    convs = [
        Conversation(f"load-{tag}-{i}", random.Random(rng.random()))
        for i in range(plan.conversations)
    ]
    async with Clients() as session:

        async def one(conv: Conversation) -> None:
            for turn in range(plan.turns):
                lo, hi = plan.opening if turn == 0 else plan.new
                await conv.turn(
                    session,
                    dep.router_url,
                    dep.reference_url,
                    conv.rng.randint(lo, hi),
                    conv.rng.randint(*plan.gen),
                )

        await asyncio.gather(*(one(c) for c in convs))
    return [t for c in convs for t in c.turns]


def run_load(dep: Deployment, plan: LoadPlan, tag: str = "0") -> LoadResult:
    """Run the plan once; hits are the router counter's delta across the run."""
    import time

    # With --workers N each scrape reaches one worker: its count is partial.
    routers = [dep.router_url] if dep.router_workers == 1 else []
    h0 = [_value(u, HITS) for u in routers]
    p0 = [_value(u, PULLS) for u in dep.prefill_urls]
    t0 = time.perf_counter()
    turns = asyncio.run(_drive(dep, plan, tag))
    seconds = time.perf_counter() - t0
    hits = _delta(h0, [_value(u, HITS) for u in routers]) if routers else None
    pulls = _delta(p0, [_value(u, PULLS) for u in dep.prefill_urls])
    return LoadResult(plan, turns, hits, pulls, dep.router_rss(), seconds)
