"""Releases of D's blocks for turns the router does not store (stub engines, loopback)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bidir_kv.protocol import KVTransferParams
from bidir_kv.router.release import RELEASE_PROMPT
from bidir_kv.router.settings import RouterSettings
from bidir_kv.router.store import Entry, MemoryStore
from bidir_kv.testing.doubles.stub_engine import StubEngine
from bidir_kv.testing.router import StubStack, counter

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"


def body(conv: str | None, text: str = "hello there") -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "stream": True,
    }
    if conv is not None:
        out["conversation_id"] = conv
    return out


def releases(engine: StubEngine) -> list[dict[str, Any]]:
    return [
        r for r in engine.received if r["headers"].get("x-request-id", "").startswith("release-")
    ]


def d_params(engine: StubEngine, index: int) -> KVTransferParams:
    """The dict the D stub answered with to its ``index``-th request (its request ids
    count up from 0)."""
    return KVTransferParams.parse(engine._params(False, 1, f"cmpl-{engine.name}-{index}"))


async def settle(s: StubStack) -> None:
    await s.flow.releaser.drain()


async def test_no_id_turn_is_released_with_remote_num_tokens_zero() -> None:
    # --identity id: a turn without an id is stored nowhere (history identity
    # would store it under its history digest)
    async with StubStack(config=RouterSettings(identity="id")) as s:
        status, _, _ = await s.post(CHAT, body(None))
        assert status == 200
        await settle(s)
        (rel,) = releases(s.prefill[0])
        assert rel["path"] == "/v1/completions"
        sent = rel["body"]
        assert sent["prompt"] == RELEASE_PROMPT and sent["max_tokens"] == 1
        assert sent["stream"] is False and sent["model"] == "tiny"
        kv = KVTransferParams.parse(sent["kv_transfer_params"])
        assert kv.remote_num_tokens == 0 and kv.do_remote_decode is True
        assert kv.do_remote_prefill is False
        assert kv.remote_block_ids and kv.remote_request_id == "cmpl-d0-0"
        assert kv.remote_host == "127.0.0.1"  # D's HTTP host, as on a hit
        assert counter(s.flow, "releases", reason="no_id") == 1


@pytest.mark.parametrize("knob", ["reasoning", "tool_call"])
async def test_untracked_delta_turn_is_released(knob: str) -> None:
    async with StubStack(config=RouterSettings(guard=False)) as s:
        setattr(s.decode[0], knob, True)
        await s.post(CHAT, body("c1"))
        await settle(s)
        assert counter(s.flow, "cache_stores") == 0
        assert counter(s.flow, "releases", reason="untracked_delta") == 1
        assert len(releases(s.prefill[0])) == 1


async def test_stored_turn_is_not_released() -> None:
    async with StubStack() as s:
        await s.post(CHAT, body("c1"))
        await settle(s)
        assert counter(s.flow, "cache_stores") == 1
        assert releases(s.prefill[0]) == []


async def test_evicted_and_stale_entries_are_released() -> None:
    now = [1000.0]
    store = MemoryStore(ttl=450, max_entries=1, now=lambda: now[0])
    async with StubStack(store=store) as s:
        await s.post(CHAT, body("a"))
        await s.post(CHAT, body("b"))  # evicts a
        await settle(s)
        assert counter(s.flow, "releases", reason="evicted") == 1
        (rel,) = releases(s.prefill[0])
        assert rel["body"]["kv_transfer_params"]["remote_request_id"] == "cmpl-d0-0"
        now[0] += 451
        assert s.session is not None
        async with s.session.get(s.url + "/health") as r:
            assert (await r.json())["evicted_stale"] == 1
        await settle(s)
        assert counter(s.flow, "releases", reason="stale") == 1


async def test_memory_store_reports_every_unused_drop() -> None:
    now = [0.0]
    store = MemoryStore(ttl=10, max_entries=2, now=lambda: now[0])
    seen: list[tuple[str, str]] = []
    store.on_evict = lambda e, why: seen.append((e.decode, why))

    def entry(name: str) -> Entry:
        return Entry(KVTransferParams.miss(), decode=name, prefill=None, created=now[0])

    await store.put("k1", entry("one"))
    await store.put("k1", entry("two"))  # replaces one
    await store.put("k2", entry("three"))
    await store.put("k3", entry("four"))  # evicts two (the oldest)
    assert (await store.take("k2")).entry is not None  # used: not reported
    now[0] = 11
    assert (await store.take("k3")).stale
    assert seen == [("one", "replaced"), ("two", "evicted"), ("four", "stale")]


async def test_releases_are_bounded_and_never_block_the_answer() -> None:
    cfg = RouterSettings(release_concurrency=1, max_pending_releases=1, identity="id")
    async with StubStack(config=cfg) as s:
        s.prefill[0].prefill_delay = 0.5  # every P call (P legs and releases) is slow
        loop = asyncio.get_running_loop()
        t = loop.time()
        answers = await asyncio.gather(*(s.post(CHAT, body(None)) for _ in range(4)))
        assert [a[0] for a in answers] == [200] * 4
        assert loop.time() - t < 1.4  # one P leg each, no answer waits on a release
        assert s.flow.releaser.pending <= 1
        assert counter(s.flow, "release_failures", cause="overflow") == 3
        await settle(s)
        assert counter(s.flow, "releases", reason="no_id") == 1
