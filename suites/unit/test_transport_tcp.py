"""TCP-specific behaviour: pooled connections after an owner restart, and a dead owner."""

from __future__ import annotations

import numpy as np
import pytest

from bidir_kv.engine.transport import KVPool, KVTransportError
from bidir_kv.engine.transport.tcp import TcpAgent
from bidir_kv.testing.poll import wait_for_async


async def test_restarted_owner_on_same_port_is_reached_through_a_fresh_connection() -> None:
    got: list[bytes] = []
    first = TcpAgent("owner", KVPool.allocate(4, 256))
    await first.start(lambda _p, m: got.append(m))
    reader = TcpAgent("reader", KVPool.allocate(4, 256))
    await reader.start(lambda _p, _m: None)
    second: TcpAgent | None = None
    try:
        await reader.add_peer(first.metadata())
        await reader.read("owner", [0], [0], b"one:1")  # leaves a pooled connection
        port = first.port
        await first.close()  # the pooled connection is now dead
        second = TcpAgent("owner", KVPool.allocate(4, 256), port=port)
        await second.start(lambda _p, m: got.append(m))
        second.pool.data[3] = 42
        await reader.read("owner", [1], [3], b"two:1")  # no add_peer: same address
        assert (reader.pool.data[1] == 42).all()
        await wait_for_async(lambda: b"two:1" in got, 30)
        assert got == [b"one:1", b"two:1"]
    finally:
        await reader.close()
        if second is not None:
            await second.close()


async def test_gone_owner_is_a_transport_error() -> None:
    owner = TcpAgent("owner", KVPool.allocate(2, 64))
    await owner.start(lambda _p, _m: None)
    reader = TcpAgent("reader", KVPool.allocate(2, 64))
    await reader.start(lambda _p, _m: None)
    try:
        await reader.add_peer(owner.metadata())
        await reader.notify("owner", b"HB:x")
        await owner.close()
        with pytest.raises(KVTransportError, match="cannot connect to peer owner"):
            await reader.read("owner", [0], [0], b"x:1")
        assert not np.any(reader.pool.data)
    finally:
        await reader.close()
