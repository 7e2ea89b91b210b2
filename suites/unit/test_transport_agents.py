"""KV agents, each backend the same contract: real bytes, owner-side checks, notifications.

Two agents in one process on loopback. The NIXL cases run whenever ``nixl`` imports
(``make test`` installs it on x86_64) and are skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from bidir_kv.engine.transport import (
    KVAgent,
    KVPool,
    TransportError,
    create_agent,
    nixl_available,
)
from bidir_kv.engine.transport.tcp import block_runs
from bidir_kv.testing.plugin import skip_or_fail

BLOCK_NBYTES = 4096
NUM_BLOCKS = 32


@pytest.fixture(params=["tcp", "nixl"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "nixl":
        ok, why = nixl_available()
        if not ok:
            skip_or_fail(request.config, "integration", f"nixl transport unavailable: {why}")
    return str(request.param)


def _filled(seed: int) -> KVPool:
    pool = KVPool.allocate(NUM_BLOCKS, BLOCK_NBYTES)
    pool.data[:] = np.random.default_rng(seed).integers(0, 256, pool.data.shape, dtype=np.uint8)
    return pool


Scenario = Callable[[KVAgent, KVAgent, list, list], Awaitable[None]]


def _run(backend: str, scenario: Scenario) -> None:
    """Owner ``d`` (seeded pool) and reader ``p`` (zeroed), both started and peered."""

    async def main() -> None:
        d = create_agent(backend, "agent-d", _filled(1))
        p = create_agent(backend, "agent-p", KVPool.allocate(NUM_BLOCKS, BLOCK_NBYTES))
        got_d: list[tuple[str, bytes]] = []
        got_p: list[tuple[str, bytes]] = []
        await d.start(lambda peer, msg: got_d.append((peer, msg)))
        await p.start(lambda peer, msg: got_p.append((peer, msg)))
        try:
            assert await p.add_peer(d.metadata()) == "agent-d"
            assert await d.add_peer(p.metadata()) == "agent-p"
            await scenario(d, p, got_d, got_p)
        finally:
            await p.close()
            await d.close()

    asyncio.run(main())


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.001)


def _sha(rows: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(rows).tobytes()).hexdigest()


def test_read_copies_exact_bytes_and_notifies_once(backend: str) -> None:
    remote = [3, 4, 5, 9, 0, 31]
    local = [10, 11, 20, 21, 22, 1]

    async def scenario(d: KVAgent, p: KVAgent, got_d: list, got_p: list) -> None:
        res = await p.read("agent-d", local, remote, b"req-7:1")
        assert _sha(p.pool.data[local]) == _sha(d.pool.data[remote])
        untouched = [b for b in range(NUM_BLOCKS) if b not in local]
        assert not p.pool.data[untouched].any()
        assert res.bytes == len(remote) * BLOCK_NBYTES
        assert res.descriptors >= 1
        assert res.xfer_time > 0 and res.post_time >= 0
        await _until(lambda: len(got_d) >= 1)
        await p.notify("agent-d", b"HB:sync")  # a later message proves nothing else is queued
        await _until(lambda: len(got_d) >= 2)
        assert got_d == [("agent-p", b"req-7:1"), ("agent-p", b"HB:sync")]
        assert got_p == []

    _run(backend, scenario)


def test_out_of_range_remote_block_fails(backend: str) -> None:
    async def scenario(d: KVAgent, p: KVAgent, got_d: list, got_p: list) -> None:
        with pytest.raises(TransportError, match=f"{NUM_BLOCKS}.*out of range|out of range"):
            await p.read("agent-d", [0, 1], [2, NUM_BLOCKS], b"bad:1")
        assert not p.pool.data.any()
        # The agent stays usable after a refused read, and no notification leaked.
        await p.read("agent-d", [0], [2], b"good:1")
        await _until(lambda: len(got_d) >= 1)
        assert got_d == [("agent-p", b"good:1")]

    _run(backend, scenario)


def test_bad_local_ids_and_pairing_fail(backend: str) -> None:
    async def scenario(d: KVAgent, p: KVAgent, got_d: list, got_p: list) -> None:
        with pytest.raises(TransportError, match="out of range"):
            await p.read("agent-d", [NUM_BLOCKS], [0], b"x:1")
        with pytest.raises(TransportError, match="pairs 2 local with 1 remote"):
            await p.read("agent-d", [0, 1], [0], b"x:1")
        with pytest.raises(TransportError, match="unknown peer"):
            await p.read("nobody", [0], [0], b"x:1")

    _run(backend, scenario)


def test_notify_only_and_many_notifications_exactly_once(backend: str) -> None:
    msgs = [f"req-{i}:1".encode() for i in range(50)]

    async def scenario(d: KVAgent, p: KVAgent, got_d: list, got_p: list) -> None:
        for m in msgs:
            await p.notify("agent-d", m)
        await d.notify("agent-p", b"HB:a,b")
        await _until(lambda: len(got_d) >= len(msgs) and len(got_p) >= 1)
        assert sorted(m for _, m in got_d) == sorted(msgs)
        assert {peer for peer, _ in got_d} == {"agent-p"}
        assert got_p == [("agent-d", b"HB:a,b")]
        assert not p.pool.data.any()  # notify moves no KV

    _run(backend, scenario)


def test_concurrent_reads_both_directions(backend: str) -> None:
    async def scenario(d: KVAgent, p: KVAgent, got_d: list, got_p: list) -> None:
        p.pool.data[16:] = 7
        await asyncio.gather(
            p.read("agent-d", [0, 1, 2, 3], [8, 9, 10, 11], b"a:1"),
            p.read("agent-d", [4, 5], [30, 31], b"b:1"),
            d.read("agent-p", [12, 13], [16, 17], b"c:1"),
        )
        assert _sha(p.pool.data[0:4]) == _sha(d.pool.data[8:12])
        assert _sha(p.pool.data[4:6]) == _sha(d.pool.data[30:32])
        assert (d.pool.data[12:14] == 7).all()
        await _until(lambda: len(got_d) >= 2 and len(got_p) >= 1)
        assert sorted(m for _, m in got_d) == [b"a:1", b"b:1"]
        assert got_p == [("agent-d", b"c:1")]

    _run(backend, scenario)


def test_async_handler_is_awaited(backend: str) -> None:
    async def main() -> None:
        seen: list[bytes] = []
        done = asyncio.Event()

        async def handler(peer: str, msg: bytes) -> None:
            await asyncio.sleep(0)
            seen.append(msg)
            done.set()

        d = create_agent(backend, "agent-d2", KVPool.allocate(4, 64))
        p = create_agent(backend, "agent-p2", KVPool.allocate(4, 64))
        await d.start(handler)
        await p.start(lambda peer, msg: None)
        try:
            await p.add_peer(d.metadata())
            await p.notify("agent-d2", b"ping:1")
            await asyncio.wait_for(done.wait(), 5)
            assert seen == [b"ping:1"]
        finally:
            await p.close()
            await d.close()

    asyncio.run(main())


def test_block_size_mismatch_refused_at_add_peer(backend: str) -> None:
    async def main() -> None:
        d = create_agent(backend, "agent-d3", KVPool.allocate(4, 64))
        p = create_agent(backend, "agent-p3", KVPool.allocate(4, 128))
        await d.start(lambda peer, msg: None)
        await p.start(lambda peer, msg: None)
        try:
            with pytest.raises(TransportError, match="64-byte blocks"):
                await p.add_peer(d.metadata())
        finally:
            await p.close()
            await d.close()

    asyncio.run(main())


def test_block_runs() -> None:
    assert list(block_runs([])) == []
    assert list(block_runs([3, 4, 5, 9, 0, 1])) == [(3, 3), (9, 1), (0, 2)]
    assert list(block_runs([5, 4])) == [(5, 1), (4, 1)]
