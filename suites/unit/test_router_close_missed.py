"""A close always wins, also over a turn that found no entry: ``DELETE
/v1/conversations/{id}`` sent while a conversation's first turn is in flight is answered
``deleted``, that turn stores nothing, and the next turn is a miss.

The store marks a turn in flight at its take whether or not an entry was there
(docs/router.md, "Closing a conversation"); a mark set only on a hit would answer the
DELETE 404 and let the first turn store an entry the client had closed.
Deterministic: the stub D holds its stream after the first token (its ``gate``) until
the DELETE has been answered. The Redis store runs the same scenario in
``suites/integration/test_router_close_race.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bidir_kv.protocol import params_from_request
from bidir_kv.router.store import ConversationStore, MemoryStore
from bidir_kv.testing.poll import wait_for_async
from bidir_kv.testing.router import StubStack, counter

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"


def _body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 8,
        "stream": True,
        "conversation_id": "first",
    }


async def close_during_the_first_turn(store: ConversationStore) -> None:
    """The scenario, on any store: turn 1 (a miss) held at D, DELETE, then turn 2."""
    async with StubStack(store=store) as s:
        assert s.session is not None
        d = s.decode[0]
        d.gate = asyncio.Event()  # D holds turn 1 after its first token
        msgs = [{"role": "user", "content": "the first question " * 4}]
        turn1 = asyncio.create_task(s.post(CHAT, _body(msgs)))
        await wait_for_async(lambda: len(d.received) > 0, what="turn 1 at D")
        async with s.session.delete(s.url + "/v1/conversations/first") as resp:
            closed = (resp.status, await resp.json())
        d.gate.set()
        status, _, _ = await turn1
        assert status == 200
        assert closed[0] == 200 and closed[1]["deleted"] is True, closed
        await s.flow.releaser.drain()
        assert await store.size() == 0  # the close won: turn 1 stored nothing
        assert counter(s.flow, "not_cached", reason="closed") == 1
        assert counter(s.flow, "releases", reason="closed") == 1  # D's blocks freed
        d.gate = None
        msgs += [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}]
        asked = len(s.prefill[0].received)
        status, _, _ = await s.post(CHAT, _body(msgs))
        assert status == 200
        params = params_from_request(s.prefill[0].received[asked]["body"])
        assert params is None or not params.has_remote_blocks  # turn 2: a miss
        assert await store.size() == 1  # a turn after the close stores again


async def test_close_wins_over_a_first_turn_in_flight_memory_store() -> None:
    await close_during_the_first_turn(MemoryStore(ttl=450, max_entries=100))
