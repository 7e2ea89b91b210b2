"""A close always wins: ``DELETE /v1/conversations/{id}`` sent while that conversation's
turn is in flight is answered ``deleted`` and remembered, and the turn's new entry is
released at its end instead of stored, on the memory and the Redis store.

Deterministic: the stub D holds its stream after the first token (its ``gate``) until
the DELETE has been answered, so the close lands inside the turn every time.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bidir_kv.protocol import params_from_request
from bidir_kv.router.store import ConversationStore, MemoryStore, RedisStore
from bidir_kv.testing.poll import wait_for_async
from bidir_kv.testing.router import StubStack, counter
from bidir_kv.topology.redis_server import RedisServer

CHAT = "/v1/chat/completions"


def _body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 8,
        "stream": True,
        "conversation_id": "race",
    }


async def _race(store: ConversationStore) -> None:
    async with StubStack(store=store) as s:
        assert s.session is not None
        msgs = [{"role": "user", "content": "the first question " * 4}]
        status, _, _ = await s.post(CHAT, _body(msgs))
        assert status == 200 and await store.size() == 1
        msgs += [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}]
        d = s.decode[0]
        d.gate = asyncio.Event()  # D holds turn 2 after its first token
        seen = len(d.received)
        turn2 = asyncio.create_task(s.post(CHAT, _body(msgs)))
        await wait_for_async(lambda: len(d.received) > seen, what="turn 2 at D")
        async with s.session.delete(s.url + "/v1/conversations/race") as resp:
            closed = (resp.status, await resp.json())
        d.gate.set()
        status, _, _ = await turn2
        assert status == 200
        assert closed[0] == 200 and closed[1]["deleted"] is True, closed
        await s.flow.releaser.drain()
        assert await store.size() == 0  # the close won: turn 2 stored nothing
        assert counter(s.flow, "not_cached", reason="closed") == 1
        assert counter(s.flow, "releases", reason="closed") == 1  # D's new blocks freed
        asked = len(s.prefill[0].received)
        status, _, _ = await s.post(
            CHAT,
            _body(
                [*msgs, {"role": "assistant", "content": "y"}, {"role": "user", "content": "again"}]
            ),
        )
        assert status == 200
        p_req = s.prefill[0].received[asked]["body"]
        params = params_from_request(p_req)
        assert params is None or not params.has_remote_blocks  # turn 3: a miss
        assert await store.size() == 1  # a turn after the close stores again


async def test_close_wins_over_a_turn_in_flight_memory_store() -> None:
    await _race(MemoryStore(ttl=450, max_entries=100))


async def test_close_wins_over_a_turn_in_flight_redis_store(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, ttl=450, max_entries=100, prefix="race:")
    try:
        await _race(store)
    finally:
        await store.close()


async def test_delete_without_entry_or_turn_is_still_404() -> None:
    async with StubStack() as s:
        assert s.session is not None
        async with s.session.delete(s.url + "/v1/conversations/nobody") as resp:
            assert resp.status == 404


async def test_close_wins_over_a_first_turn_in_flight_redis_store(
    redis_server: RedisServer,
) -> None:
    """A turn that found no entry is in flight too (the memory store's case is in the
    unit tier: suites/unit/test_router_close_missed.py)."""
    from suites.unit.test_router_close_missed import close_during_the_first_turn

    store = RedisStore(redis_server.url, ttl=450, max_entries=100, prefix="first:")
    try:
        await close_during_the_first_turn(store)
    finally:
        await store.close()
