"""Placement: reserved (picked, not finished) and held work count in the choice of D."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from bidir_kv.policy import least_loaded, node_load
from bidir_kv.router.upstreams import UpstreamPool
from bidir_kv.testing.router import StubStack

pytestmark = pytest.mark.unit


def pool(n: int = 2, held_weight: float = 0.25, held_ttl: float = 450.0) -> UpstreamPool:
    return UpstreamPool(
        "decode",
        ["127.0.0.1"] * n,
        list(range(9000, 9000 + n)),
        held_weight=held_weight,
        held_ttl=held_ttl,
    )


def test_rule() -> None:
    assert node_load(2, 4, 0.25) == 3.0
    assert least_loaded([1.0, 0.5, 0.5]) == [1, 2]
    assert least_loaded([]) == []


def test_picks_reserved_at_once_split_evenly_behind_a_busy_node() -> None:
    """One D busy with a request; 16 new turns picked before any of their legs starts
    (each reserves its D at the pick) end up split, not all on the idle D."""
    p = pool()
    p.nodes[0].inflight = p.nodes[0].reserved = 1
    picks = []
    for _ in range(16):
        node = p.pick()
        assert node is not None
        node.reserved += 1
        picks.append(node.id)
    counts = Counter(picks)
    assert counts[p.nodes[1].id] in (8, 9) and counts[p.nodes[0].id] in (7, 8)


def test_held_turns_weigh_in() -> None:
    p = pool(held_weight=0.25)
    for i in range(8):
        p.hold(p.nodes[0].id, f"r{i}")  # 8 turns pinned on D0: load 2
    p.nodes[1].reserved = 1  # one request on D1: load 1
    assert p.pick() is p.nodes[1]
    p.unhold(p.nodes[0].id, "r0")
    assert p.held_count(p.nodes[0]) == 7


def test_held_turns_are_forgotten_after_the_ttl() -> None:
    p = pool(held_ttl=0.0)
    p.hold(p.nodes[0].id, "r")
    assert p.held_count(p.nodes[0], now=1e18) == 0


def test_sticky_choice_still_wins() -> None:
    p = pool()
    p.nodes[0].reserved = 5
    assert p.pick(p.nodes[0].id) is p.nodes[0]


async def test_router_reserves_d_during_the_p_leg() -> None:
    """Through the router: concurrent new conversations while P is slow (nobody has
    reached its D leg when the others are placed) split over the two D stubs."""
    async with StubStack(num_decode=2) as s:
        s.prefill[0].prefill_delay = 0.3
        s.flow.decode.nodes[0].reserved = 1  # D0 busy with one turn already

        async def one(i: int) -> int:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"c{i}"}],
                "max_tokens": 2,
                "stream": False,
                "conversation_id": f"c{i}",
            }
            status, _, _ = await s.post("/v1/chat/completions", body)
            return status

        assert await asyncio.gather(*(one(i) for i in range(16))) == [200] * 16
        on = [len(d.received) for d in s.decode]
        assert sum(on) == 16 and min(on) >= 6, on
