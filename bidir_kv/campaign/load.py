"""The load campaign: N conversations x T turns at once, every answer checked by the oracle.

All conversations run concurrently, turn after turn; the router's own counters give
the hit rate on turns >= 2 (hits are counted only when P took D's tokens), the
client's clock gives p50/p99 per turn, /proc the router's resident memory.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import aiohttp

from bidir_kv.campaign.client import Conversation, Turn
from bidir_kv.campaign.deploy import Deployment
from bidir_kv.scrape import scrape

__all__ = ["LoadPlan", "LoadResult", "run_load"]

HITS = "bidir_kv_router_cache_hits_total"


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
    turns: list[Turn] = field(default_factory=list)
    hits: float | None = None
    router_rss: int | None = None
    seconds: float = 0.0

    @property
    def failed(self) -> int:
        return sum(1 for t in self.turns if not 200 <= t.status < 300 or t.error)

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
        if self.hits is None or not self.later_turns:
            return None
        return self.hits / self.later_turns

    def latency(self, q: float) -> float:
        xs = sorted(t.elapsed for t in self.turns)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    def holds(self, min_hit_rate: float) -> bool:
        rate = self.hit_rate
        return (self.failed == 0 and not self.wrong
                and (rate is None or rate >= min_hit_rate))


def _router_hits(url: str) -> float | None:
    try:
        return scrape(url).value(HITS)
    except (OSError, ValueError):
        return None


async def _drive(dep: Deployment, plan: LoadPlan, tag: str) -> list[Turn]:
    rng = random.Random(plan.seed)
    convs = [Conversation(f"load-{tag}-{i}", random.Random(rng.random()))
             for i in range(plan.conversations)]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(conv: Conversation) -> None:
            for turn in range(plan.turns):
                lo, hi = plan.opening if turn == 0 else plan.new
                await conv.turn(session, dep.router_url, dep.reference_url,
                                conv.rng.randint(lo, hi), conv.rng.randint(*plan.gen))

        await asyncio.gather(*(one(c) for c in convs))
    return [t for c in convs for t in c.turns]


def run_load(dep: Deployment, plan: LoadPlan, tag: str = "0") -> LoadResult:
    """Run the plan once; hits are the router counter's delta across the run."""
    import time

    h0 = _router_hits(dep.router_url)
    t0 = time.perf_counter()
    turns = asyncio.run(_drive(dep, plan, tag))
    seconds = time.perf_counter() - t0
    h1 = _router_hits(dep.router_url)
    hits = None if h0 is None or h1 is None else h1 - h0
    return LoadResult(plan, turns, hits, dep.router_rss(), seconds)
