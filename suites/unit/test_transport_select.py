"""create_agent: backend choice, and the fallback from NIXL to TCP when UCX cannot start."""

from __future__ import annotations

import logging

import pytest

from bidir_kv.engine.transport import KVPool, KVTransportError, create_agent, nixl_available
from bidir_kv.engine.transport.tcp import TcpAgent
from bidir_kv.testing.transports import require_nixl


def _pool() -> KVPool:
    return KVPool.allocate(2, 64)


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown transport 'rdma'"):
        create_agent("rdma", "x", _pool())


def test_tcp_is_tcp() -> None:
    agent = create_agent("tcp", "x", _pool(), host="127.0.0.1", port=0)
    assert isinstance(agent, TcpAgent) and agent.backend == "tcp"


def test_auto_prefers_nixl(nixl_ok: None) -> None:
    assert nixl_available()[1].startswith("nixl")
    assert create_agent("auto", "auto-nixl", _pool()).backend == "nixl"


def test_ucx_without_tcp_falls_back_or_fails_clearly(
    nixl_ok: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # docs/vllm-cpu.md §6.4: UCX_TLS without tcp leaves UCX no active-message transport.
    monkeypatch.setenv("UCX_TLS", "sm,self")
    with caplog.at_level(logging.WARNING, logger="bidir_kv.engine.transport"):
        agent = create_agent("auto", "auto-fallback", _pool())
    assert agent.backend == "tcp"
    assert any("using TCP" in m and "UCX_TLS=sm,self" in m for m in caplog.messages)
    with pytest.raises(KVTransportError, match="has no tcp"):
        create_agent("nixl", "forced-nixl", _pool())


def test_tcp_wildcard_host_advertises_the_hostname() -> None:
    # Property only: tests never listen beyond loopback.
    import socket

    assert TcpAgent("w", _pool(), host="0.0.0.0").advertised_host == socket.gethostname()
    assert TcpAgent("w", _pool(), host="::").advertised_host == socket.gethostname()
    assert TcpAgent("w", _pool(), host="127.0.0.1").advertised_host == "127.0.0.1"


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
async def test_add_peer_names_what_is_wrong_with_metadata(
    backend: str, request: pytest.FixtureRequest
) -> None:
    import msgpack

    if backend == "nixl":
        require_nixl(request.config)
    agent = create_agent(backend, f"md-{backend}", _pool())
    await agent.start(lambda _p, _m: None)
    try:
        good = msgpack.unpackb(agent.metadata())
        lacking = {k: v for k, v in good.items() if k != "num_blocks"}
        with pytest.raises(KVTransportError, match="lacks 'num_blocks'"):
            await agent.add_peer(msgpack.packb(lacking))
        with pytest.raises(KVTransportError, match=r"'port'|'base'"):
            bad = dict(good, port="x", base="x")
            await agent.add_peer(msgpack.packb(bad))
        with pytest.raises(KVTransportError, match="not from a"):
            await agent.add_peer(msgpack.packb(dict(good, transport="carrier-pigeon")))
        with pytest.raises(KVTransportError, match="malformed"):
            await agent.add_peer(b"\xc1")
    finally:
        await agent.close()
