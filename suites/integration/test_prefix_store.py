"""The prefix index in both stores, with the same tests: memory and a private Redis.

A history entry is found under any of its index keys (``take_first``), longest probe
first; a take removes it with every index key, so no other key hands it out again; every
other removal (eviction, the stale sweep, lease expiry) leaves no index behind; the newest
turn wins a key two turns share; with two router replicas on one Redis, concurrent takes
of one entry give it to exactly one.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bidir_kv.protocol import KVTransferParams
from bidir_kv.router.store import ConversationStore, Entry, MemoryStore, RedisStore

_prefixes = itertools.count()


def entry(tag: str, created: float = 100.0, lease: float | None = None) -> Entry:
    params = KVTransferParams.build(
        do_remote_decode=True, remote_block_ids=[[1, 2]], remote_request_id=tag
    )
    return Entry(params=params, decode="d", prefill="p", created=created, lease=lease)


class Clock:
    def __init__(self) -> None:
        self.now = 101.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
async def stores(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Any, Clock]]:
    """A factory of stores of one kind sharing one backing (Redis: one key prefix)."""
    clock = Clock()
    made: list[ConversationStore] = []
    if request.param == "memory":
        shared = MemoryStore(ttl=10, max_entries=3, now=clock)

        def make() -> ConversationStore:
            return shared
    else:
        server = request.getfixturevalue("redis_server")
        prefix = f"t{next(_prefixes)}:"

        def make() -> ConversationStore:
            store = RedisStore(server.url, ttl=10, max_entries=3, now=clock, prefix=prefix)
            made.append(store)
            return store

    try:
        yield make, clock
    finally:
        for store in made:
            await store.close()


async def leftovers(store: ConversationStore) -> int:
    """Index keys and lists still held (0 once every indexed entry is gone)."""
    if isinstance(store, MemoryStore):
        return len(store._index) + len(store._indexed)
    assert isinstance(store, RedisStore)
    keys = [k async for k in store._redis.scan_iter(match=f"{store.prefix}*")]
    return sum(1 for k in keys if b":pfx:" in k or b":ixof:" in k)


async def test_found_under_a_shorter_key_then_gone_under_every_key(stores: Any) -> None:
    make, _ = stores
    store = make()
    await store.put("t#full", entry("a"), index=["t#full", "t#p3", "t#p1"])
    taken = await store.take_first(["t#none", "t#p3", "t#p1"])
    assert taken.entry is not None and taken.entry.params.remote_request_id == "a"
    assert taken.matched == 1
    for key in ("t#full", "t#p3", "t#p1"):
        assert (await store.take_first([key])).entry is None
    assert await leftovers(store) == 0 and await store.size() == 0


async def test_the_newest_turn_wins_a_shared_key(stores: Any) -> None:
    make, _ = stores
    store = make()
    await store.put("t#a", entry("a"), index=["t#a", "t#shared"])
    await store.put("t#b", entry("b"), index=["t#b", "t#shared"])
    got = (await store.take_first(["t#shared"])).entry
    assert got is not None and got.params.remote_request_id == "b"
    got = (await store.take_first(["t#shared", "t#a"])).entry  # "shared" left with b
    assert got is not None and got.params.remote_request_id == "a"
    assert await leftovers(store) == 0


async def test_eviction_sweep_and_lease_expiry_leave_no_index(stores: Any) -> None:
    make, clock = stores
    store = make()
    gone: list[tuple[str, str]] = []
    store.on_evict = lambda e, why: gone.append((e.params.remote_request_id, why))
    for i in range(4):  # bound 3: the first is evicted
        await store.put(f"t#{i}", entry(str(i), created=100.0 + i), index=[f"t#{i}", f"t#x{i}"])
    assert ("0", "evicted") in gone
    assert (await store.take_first(["t#x0", "t#0"])).entry is None
    await store.put("t#l", entry("l", created=104.0, lease=1.0), index=["t#l", "t#xl"])
    clock.now = 105.5  # the lease (1 s) has passed; the others are still fresh
    assert await store.expire_leases() >= 1
    clock.now = 200.0  # everything stale
    await store.sweep()
    assert {why for _, why in gone} >= {"evicted", "lease_expired", "stale"}
    assert await leftovers(store) == 0


async def test_a_stale_entry_found_by_a_key_is_reported_not_reused(stores: Any) -> None:
    make, clock = stores
    store = make()
    gone: list[str] = []
    store.on_evict = lambda e, why: gone.append(why)
    await store.put("t#s", entry("s"), index=["t#s", "t#ps"])
    clock.now = 200.0
    taken = await store.take_first(["t#ps"])
    assert taken.entry is None and taken.stale and gone == ["stale"]
    assert await leftovers(store) == 0


async def test_concurrent_takes_through_two_keys_give_the_entry_once(stores: Any) -> None:
    make, _ = stores
    a, b = make(), make()  # two router replicas (Redis) or one process (memory)
    for round_ in range(20):
        await a.put(f"t#e{round_}", entry(str(round_)), index=[f"t#e{round_}", f"t#q{round_}"])
        got = await asyncio.gather(
            a.take_first([f"t#q{round_}"]), b.take_first([f"t#e{round_}", f"t#q{round_}"])
        )
        assert sum(t.entry is not None for t in got) == 1
    assert await leftovers(a) == 0
