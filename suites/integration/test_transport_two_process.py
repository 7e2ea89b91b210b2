"""Transports across two processes: side-channel handshake, real reads, notifications, death.

The owner is ``python -m bidir_kv.tools.transport_peer owner`` (a seeded pool behind a
side channel, logging each notification it receives); the reader is this process.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bidir_kv.engine.transport import KVAgent, KVPool, KVTransportError, create_agent
from bidir_kv.engine.transport.sidechannel import PeerInfo, handshake
from bidir_kv.testing.poll import wait_for
from bidir_kv.tools.transport_peer import PeerProcess, seeded_pool_bytes, spawn

NUM_BLOCKS = 64
BLOCK_NBYTES = 64 * 1024  # 4 MiB pool
SEED = 5


def _spawn_owner(kv_backend: str, workdir: Path) -> PeerProcess:
    return spawn(
        [
            "owner",
            "--transport",
            kv_backend,
            "--num-blocks",
            str(NUM_BLOCKS),
            "--block-nbytes",
            str(BLOCK_NBYTES),
            "--seed",
            str(SEED),
            "--engine-id",
            "d-1",
        ],
        workdir,
    )


@pytest.fixture(scope="module")
def owner(kv_backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerProcess]:
    """One owner process per backend; tests tell their notifications apart by reader name."""
    peer = _spawn_owner(kv_backend, tmp_path_factory.mktemp(f"owner-{kv_backend}"))
    try:
        yield peer
    finally:
        peer.stop()


@pytest.fixture
def own_owner(kv_backend: str, tmp_path: Path) -> Iterator[PeerProcess]:
    """An owner this test may kill."""
    peer = _spawn_owner(kv_backend, tmp_path / "owner")
    try:
        yield peer
    finally:
        peer.stop()


async def _connect(
    kv_backend: str, owner: PeerProcess, name: str = "reader"
) -> tuple[KVAgent, str, PeerInfo]:
    agent = create_agent(kv_backend, name, KVPool.allocate(NUM_BLOCKS, BLOCK_NBYTES))
    await agent.start(lambda _p, _m: None)
    info = await handshake(
        "127.0.0.1",
        owner.ready["side_channel_port"],
        local_hash=owner.ready["compat_hash"],
        expected_engine_id="d-1",
        backend=kv_backend,
    )
    return agent, await agent.add_peer(info.meta.agent_metadata), info


def _wait_notifs(
    owner: PeerProcess, readers: set[str], n: int, timeout: float = 30.0
) -> list[tuple[str, str]]:
    """The owner's notifications from ``readers`` once there are ``n``."""

    def enough() -> list[tuple[str, str]] | None:
        got = [(r, m) for r, m in owner.notifications() if r in readers]
        return got if len(got) >= n else None

    return wait_for(enough, timeout, f"{n} notification(s) from {sorted(readers)}", interval=0.01)


async def test_read_across_processes(kv_backend: str, owner: PeerProcess) -> None:
    expected = seeded_pool_bytes(SEED, NUM_BLOCKS, BLOCK_NBYTES)
    remote = [5, 6, 7, 8, 40, 63, 0]
    local = [0, 1, 2, 3, 10, 11, 50]
    agent, peer, info = await _connect(kv_backend, owner, "reader-1")
    try:
        # Same machine, same monotonic clock: the offset is within half the best RTT.
        assert abs(info.offset) <= info.rtt / 2 + 1e-6
        assert info.meta.num_blocks == NUM_BLOCKS
        res = await agent.read(peer, local, remote, b"cmpl-d-1:1")
        assert res.bytes == len(remote) * BLOCK_NBYTES
        got = hashlib.sha256(agent.pool.data[local].tobytes()).hexdigest()
        assert got == hashlib.sha256(expected[remote].tobytes()).hexdigest()
        others = [b for b in range(NUM_BLOCKS) if b not in local]
        assert not agent.pool.data[others].any()
        await agent.notify(peer, b"HB:cmpl-p-9")
    finally:
        await agent.close()
    notifs = _wait_notifs(owner, {"reader-1"}, 2)
    assert notifs == [("reader-1", "cmpl-d-1:1"), ("reader-1", "HB:cmpl-p-9")]


async def test_whole_pool_read_matches_owner_hash(kv_backend: str, owner: PeerProcess) -> None:
    agent, peer, _ = await _connect(kv_backend, owner, "reader-2")
    try:
        ids = list(range(NUM_BLOCKS))
        await agent.read(peer, ids, ids, b"all:1")
        assert hashlib.sha256(agent.pool.data.tobytes()).hexdigest() == owner.ready["sha256"]
    finally:
        await agent.close()


async def test_out_of_range_and_no_stray_notification(kv_backend: str, owner: PeerProcess) -> None:
    agent, peer, _ = await _connect(kv_backend, owner, "reader-3")
    try:
        with pytest.raises(KVTransportError, match="out of range"):
            await agent.read(peer, [0], [NUM_BLOCKS + 3], b"bad:1")
        await agent.read(peer, [1], [1], b"good:1")
    finally:
        await agent.close()
    assert _wait_notifs(owner, {"reader-3"}, 1) == [("reader-3", "good:1")]


async def test_two_readers_each_notify_exactly_once(kv_backend: str, owner: PeerProcess) -> None:
    a, pa, _ = await _connect(kv_backend, owner, "reader-a")
    b, pb, _ = await _connect(kv_backend, owner, "reader-b")
    try:
        await asyncio.gather(
            *(a.read(pa, [i], [i], f"a-{i}:1".encode()) for i in range(8)),
            *(b.read(pb, [i], [63 - i], f"b-{i}:1".encode()) for i in range(8)),
        )
        expected = seeded_pool_bytes(SEED, NUM_BLOCKS, BLOCK_NBYTES)
        assert np.array_equal(a.pool.data[:8], expected[:8])
        assert np.array_equal(b.pool.data[:8], expected[63:55:-1])
    finally:
        await a.close()
        await b.close()
    notifs = _wait_notifs(owner, {"reader-a", "reader-b"}, 16)
    assert sorted(notifs) == sorted(
        [("reader-a", f"a-{i}:1") for i in range(8)] + [("reader-b", f"b-{i}:1") for i in range(8)]
    )


async def test_dead_owner_fails_the_read_instead_of_hanging(
    kv_backend: str, own_owner: PeerProcess
) -> None:
    owner = own_owner
    agent, peer, _ = await _connect(kv_backend, owner, "reader-4")
    agent.io_timeout = 10.0
    try:
        await agent.read(peer, [0], [0], b"warm:1")
        owner.stop()
        with pytest.raises(KVTransportError):
            await agent.read(peer, [1, 2], [1, 2], b"late:1")
        with pytest.raises(KVTransportError):
            await handshake(
                "127.0.0.1",
                owner.ready["side_channel_port"],
                local_hash=owner.ready["compat_hash"],
                timeout=2.0,
            )
    finally:
        await agent.close()


async def test_many_random_concurrent_reads_are_exact(kv_backend: str, owner: PeerProcess) -> None:
    """200 reads of random block sets, 8 in flight, each checked; one notification each."""
    import random

    rng = random.Random(1234)
    expected = seeded_pool_bytes(SEED, NUM_BLOCKS, BLOCK_NBYTES)
    jobs = []
    for i in range(200):
        n = rng.randint(1, 6)
        jobs.append((i, rng.sample(range(NUM_BLOCKS), n)))
    agents = [await _connect(kv_backend, owner, f"rnd-{k}") for k in range(8)]
    try:

        async def lane(k: int) -> None:
            agent, peer, _ = agents[k]
            for i, remote in jobs[k::8]:
                local = list(range(len(remote)))
                agent.pool.data[local] = 0
                await agent.read(peer, local, remote, f"rnd-{i}:1".encode())
                assert np.array_equal(agent.pool.data[local], expected[remote]), i

        await asyncio.gather(*(lane(k) for k in range(8)))
    finally:
        for agent, _, _ in agents:
            await agent.close()
    readers = {f"rnd-{k}" for k in range(8)}
    notifs = _wait_notifs(owner, readers, 200)
    assert sorted(m for _, m in notifs) == sorted(f"rnd-{i}:1" for i in range(200))
