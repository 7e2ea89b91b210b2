"""KV agents, each backend the same contract: real bytes, owner-side checks, notifications.

Two agents in one process on loopback. The NIXL cases run whenever ``nixl`` imports
(``make test`` installs it on x86_64) and are skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator

import numpy as np
import pytest

from bidir_kv.engine.transport import (
    KVPool,
    KVTransportError,
    create_agent,
)
from bidir_kv.engine.transport.tcp_io import block_runs
from bidir_kv.testing.poll import wait_for_async

BLOCK_NBYTES = 4096
NUM_BLOCKS = 32
FENCE_SLOTS = 8


def _seeded(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (NUM_BLOCKS, BLOCK_NBYTES), dtype=np.uint8)


class Pair:
    """Owner ``d`` (seeded pool) and reader ``p`` (zeroed), started once per backend.

    Agent start-up (a UCX context for NIXL) dominates these tests, so one pair serves
    the module on one event loop; each test gets fresh pool contents and empty inboxes.
    """

    def __init__(self, kv_backend: str) -> None:
        self.d = create_agent(kv_backend, "agent-d", KVPool.allocate(NUM_BLOCKS, BLOCK_NBYTES))
        self.p = create_agent(kv_backend, "agent-p", KVPool.allocate(NUM_BLOCKS, BLOCK_NBYTES))
        self.fence = np.zeros(FENCE_SLOTS, dtype=np.uint64)
        self.d.attach_fence(self.fence)  # d publishes fence words, p does not
        self.got_d: list[tuple[str, bytes]] = []
        self.got_p: list[tuple[str, bytes]] = []

    async def start(self) -> None:
        async def on_d(peer: str, msg: bytes) -> None:  # async handlers are awaited
            await asyncio.sleep(0)
            self.got_d.append((peer, msg))

        await self.d.start(on_d)
        await self.p.start(lambda peer, msg: self.got_p.append((peer, msg)))
        assert await self.p.add_peer(self.d.metadata()) == "agent-d"
        assert await self.d.add_peer(self.p.metadata()) == "agent-p"

    async def close(self) -> None:
        await self.p.close()
        await self.d.close()

    def reset(self) -> None:
        self.d.pool.data[:] = _seeded(1)
        self.p.pool.data[:] = 0
        self.got_d.clear()
        self.got_p.clear()


@pytest.fixture(scope="module")
async def shared(kv_backend: str) -> AsyncIterator[Pair]:
    pair = Pair(kv_backend)
    await pair.start()
    try:
        yield pair
    finally:
        await pair.close()


@pytest.fixture
def pair(shared: Pair) -> Pair:
    """The module's pair with fresh pool contents and empty inboxes."""
    shared.reset()
    return shared


def _sha(rows: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(rows).tobytes()).hexdigest()


async def test_read_copies_exact_bytes_and_notifies_once(pair: Pair) -> None:
    remote = [3, 4, 5, 9, 0, 31]
    local = [10, 11, 20, 21, 22, 1]
    d, p, got_d, got_p = pair.d, pair.p, pair.got_d, pair.got_p
    res = await p.read("agent-d", local, remote, b"req-7:1")
    assert _sha(p.pool.data[local]) == _sha(d.pool.data[remote])
    untouched = [b for b in range(NUM_BLOCKS) if b not in local]
    assert not p.pool.data[untouched].any()
    assert res.bytes == len(remote) * BLOCK_NBYTES
    assert res.descriptors >= 1
    assert res.xfer_time > 0 and res.post_time >= 0
    await wait_for_async(lambda: len(got_d) >= 1, 30)
    await p.notify("agent-d", b"HB:sync")  # a later message proves nothing else is queued
    await wait_for_async(lambda: len(got_d) >= 2, 30)
    assert got_d == [("agent-p", b"req-7:1"), ("agent-p", b"HB:sync")]
    assert got_p == []


async def test_out_of_range_remote_block_fails(pair: Pair) -> None:
    p, got_d = pair.p, pair.got_d
    with pytest.raises(KVTransportError, match=f"{NUM_BLOCKS}.*out of range|out of range"):
        await p.read("agent-d", [0, 1], [2, NUM_BLOCKS], b"bad:1")
    assert not p.pool.data.any()
    # The agent stays usable after a refused read, and no notification leaked.
    await p.read("agent-d", [0], [2], b"good:1")
    await wait_for_async(lambda: len(got_d) >= 1, 30)
    assert got_d == [("agent-p", b"good:1")]


async def test_bad_local_ids_and_pairing_fail(pair: Pair) -> None:
    p = pair.p
    with pytest.raises(KVTransportError, match="out of range"):
        await p.read("agent-d", [NUM_BLOCKS], [0], b"x:1")
    with pytest.raises(KVTransportError, match="pairs 2 local with 1 remote"):
        await p.read("agent-d", [0, 1], [0], b"x:1")
    with pytest.raises(KVTransportError, match="unknown peer"):
        await p.read("nobody", [0], [0], b"x:1")


async def test_notify_only_and_many_notifications_exactly_once(pair: Pair) -> None:
    msgs = [f"req-{i}:1".encode() for i in range(50)]
    d, p, got_d, got_p = pair.d, pair.p, pair.got_d, pair.got_p
    for m in msgs:
        await p.notify("agent-d", m)
    await d.notify("agent-p", b"HB:a,b")
    await wait_for_async(lambda: len(got_d) >= len(msgs) and len(got_p) >= 1, 30)
    assert sorted(m for _, m in got_d) == sorted(msgs)
    assert {peer for peer, _ in got_d} == {"agent-p"}
    assert got_p == [("agent-d", b"HB:a,b")]
    assert not p.pool.data.any()  # notify moves no KV


async def test_concurrent_reads_both_directions(pair: Pair) -> None:
    d, p, got_d, got_p = pair.d, pair.p, pair.got_d, pair.got_p
    p.pool.data[16:] = 7
    await asyncio.gather(
        p.read("agent-d", [0, 1, 2, 3], [8, 9, 10, 11], b"a:1"),
        p.read("agent-d", [4, 5], [30, 31], b"b:1"),
        d.read("agent-p", [12, 13], [16, 17], b"c:1"),
    )
    assert _sha(p.pool.data[0:4]) == _sha(d.pool.data[8:12])
    assert _sha(p.pool.data[4:6]) == _sha(d.pool.data[30:32])
    assert (d.pool.data[12:14] == 7).all()
    await wait_for_async(lambda: len(got_d) >= 2 and len(got_p) >= 1, 30)
    assert sorted(m for _, m in got_d) == [b"a:1", b"b:1"]
    assert got_p == [("agent-d", b"c:1")]


async def test_block_size_mismatch_refused_at_add_peer(kv_backend: str, shared: Pair) -> None:
    other = create_agent(kv_backend, "agent-other", KVPool.allocate(4, 128))
    await other.start(lambda peer, msg: None)
    try:
        with pytest.raises(KVTransportError, match="128-byte blocks"):
            await shared.p.add_peer(other.metadata())
    finally:
        await other.close()


def test_block_runs() -> None:
    assert list(block_runs([])) == []
    assert list(block_runs([3, 4, 5, 9, 0, 1])) == [(3, 3), (9, 1), (0, 2)]
    assert list(block_runs([5, 4])) == [(5, 1), (4, 1)]


async def test_re_adding_a_peer_replaces_its_state(pair: Pair) -> None:
    # A re-registered engine (new registration generation) is added again; reads go on.
    d, p, got_d = pair.d, pair.p, pair.got_d
    assert await p.add_peer(d.metadata()) == "agent-d"
    await p.read("agent-d", [2], [7], b"again:1")
    assert np.array_equal(p.pool.data[2], d.pool.data[7])
    await wait_for_async(lambda: len(got_d) >= 1, 30)
    assert got_d == [("agent-p", b"again:1")]


async def test_cancelled_read_leaves_the_agent_usable(pair: Pair) -> None:
    d, p, got_d = pair.d, pair.p, pair.got_d
    ids = list(range(NUM_BLOCKS))
    task = asyncio.create_task(p.read("agent-d", ids, ids, b"cancel:1"))
    await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await p.read("agent-d", [0], [5], b"after:1")
    assert np.array_equal(p.pool.data[0], d.pool.data[5])
    await wait_for_async(lambda: ("agent-p", b"after:1") in got_d, 30)
    msgs = [m for _, m in got_d]
    assert msgs.count(b"after:1") == 1 and msgs.count(b"cancel:1") <= 1


async def test_fence_word_reads_the_owners_current_value(pair: Pair) -> None:
    """The fence (docs/connector.md §5): a one-sided READ of one word sees the owner's
    latest write, delivers no notification, and only an owner that published words has them."""
    d, p, got_d = pair.d, pair.p, pair.got_d
    assert d.fence_registered and p.peer_has_fence("agent-d")
    assert not p.fence_registered and not d.peer_has_fence("agent-p")
    assert d.fence is not None
    d.fence[3] = 2**63 + 5  # the full 64-bit range travels
    assert await p.read_word("agent-d", 3) == 2**63 + 5
    d.fence[3] = 7  # the owner bumps: the next read sees it
    assert await p.read_word("agent-d", 3) == 7
    with pytest.raises(KVTransportError):
        await p.read_word("agent-d", FENCE_SLOTS)
    with pytest.raises(KVTransportError):
        await d.read_word("agent-p", 0)
    await p.notify("agent-d", b"HB:sync")
    await wait_for_async(lambda: len(got_d) >= 1, 30)
    assert got_d == [("agent-p", b"HB:sync")]  # the word reads notified nothing


async def test_fence_words_nixl_cannot_register_mean_no_fence(
    nixl_ok: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A fence table NIXL refuses: one warning, an agent without the fence (no
    metadata fields, so peers read it as stock), and KV reads still work. (TCP serves
    the words from its data port: nothing to register.)"""

    class Refusing:
        def __init__(self, inner: object) -> None:
            self.inner, self.calls = inner, 0

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

        def register_memory(self, *args: object, **kw: object) -> object:
            self.calls += 1
            if self.calls == 2:  # the pool registers first, the fence words second
                raise RuntimeError("NIXL_ERR_BACKEND (injected)")
            return self.inner.register_memory(*args, **kw)  # type: ignore[attr-defined]

    d = create_agent("nixl", "agent-d2", KVPool.allocate(NUM_BLOCKS, BLOCK_NBYTES))
    p = create_agent("nixl", "agent-p2", KVPool.allocate(NUM_BLOCKS, BLOCK_NBYTES))
    d.attach_fence(np.zeros(FENCE_SLOTS, dtype=np.uint64))
    d._nixl = Refusing(d._nixl)  # type: ignore[attr-defined]
    with caplog.at_level("WARNING", logger="bidir_kv.engine.transport"):
        try:
            await d.start(lambda peer, msg: None)
            await p.start(lambda peer, msg: None)
            assert not d.fence_registered
            await p.add_peer(d.metadata())
            assert not p.peer_has_fence("agent-d2")
            d.pool.data[:] = _seeded(2)
            await p.read("agent-d2", [1, 2], [3, 4], b"")
            assert _sha(p.pool.data[[1, 2]]) == _sha(d.pool.data[[3, 4]])
        finally:
            await p.close()
            await d.close()
    lines = [r for r in caplog.records if "fence words could not be registered" in r.getMessage()]
    assert len(lines) == 1 and "stock behaviour" in lines[0].getMessage()
