"""Side channel: metadata handshake, compatibility and engine-id checks, clock offset."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from bidir_kv.engine.transport import KVTransportError
from bidir_kv.engine.transport.sidechannel import (
    EngineMetadata,
    SideChannelServer,
    compatibility_hash,
    handshake,
    side_channel_address,
)

HASH = compatibility_hash({"model": "tiny", "block_size": 16})


def _meta(**over: object) -> EngineMetadata:
    base: dict[str, object] = dict(
        engine_id="engine-d",
        compat_hash=HASH,
        backend="tcp",
        agent_metadata=b"\x00opaque\xff",
        block_size=16,
        block_nbytes=4096,
        num_blocks=8,
        registration_generation=3,
    )
    base.update(over)
    return EngineMetadata(**base)  # type: ignore[arg-type]


async def _with_server(
    meta: Callable[[], EngineMetadata], body, clock: Callable[[], float] | None = None
):
    server = SideChannelServer("127.0.0.1", 0, meta, **({"clock": clock} if clock else {}))
    await server.start()
    try:
        return await body(server.port)
    finally:
        await server.close()


async def test_handshake_returns_metadata_and_logs_compat(caplog: pytest.LogCaptureFixture) -> None:
    async def body(port: int):
        return await handshake(
            "127.0.0.1", port, local_hash=HASH, expected_engine_id="engine-d", backend="tcp"
        )

    with caplog.at_level(logging.INFO, logger="bidir_kv.engine.transport"):
        info = await _with_server(_meta, body)
    assert info.meta == _meta()
    assert info.engine_id == "engine-d"
    assert len(info.samples) == 3
    assert f"NIXL compatibility check passed (hash: {HASH})" in caplog.messages


async def test_offset_reflects_remote_clock_skew() -> None:
    # The responder's clock runs 1000 s ahead of ours; RTT on loopback is far below 0.1 s.
    import time

    skew = 1000.0

    async def body(port: int):
        return await handshake("127.0.0.1", port, local_hash=HASH, samples=5)

    info = await _with_server(_meta, body, clock=lambda: time.perf_counter() + skew)
    assert abs(info.offset - skew) <= info.rtt / 2 + 1e-6  # remote_now lies within [send, recv]
    assert info.rtt == min(s.rtt for s in info.samples)


async def test_compat_mismatch_refused_unless_not_enforced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    other = compatibility_hash({"model": "tiny", "block_size": 32})
    assert other != HASH

    async def strict(port: int):
        return await handshake("127.0.0.1", port, local_hash=other)

    with pytest.raises(KVTransportError, match="compatibility hash mismatch"):
        await _with_server(_meta, strict)

    async def lax(port: int):
        return await handshake("127.0.0.1", port, local_hash=other, enforce_compat=False)

    with caplog.at_level(logging.WARNING, logger="bidir_kv.engine.transport"):
        info = await _with_server(_meta, lax)
    assert info.meta.compat_hash == HASH
    assert any("enforce_handshake_compat is false" in m for m in caplog.messages)


def test_version_changes_hash() -> None:
    assert compatibility_hash(version="0.1.0") != compatibility_hash(version="0.2.0")
    assert compatibility_hash(connector_version=1) != compatibility_hash(connector_version=2)


async def test_engine_id_mismatch() -> None:
    async def body(port: int):
        return await handshake("127.0.0.1", port, local_hash=HASH, expected_engine_id="other")

    with pytest.raises(KVTransportError, match=r"engine id mismatch.*expected other.*engine-d"):
        await _with_server(_meta, body)


async def test_backend_mismatch() -> None:
    async def body(port: int):
        return await handshake("127.0.0.1", port, local_hash=HASH, backend="nixl")

    with pytest.raises(KVTransportError, match="peer uses tcp, we use nixl"):
        await _with_server(_meta, body)


async def test_generation_seen_per_handshake() -> None:
    gen = {"n": 0}

    async def body(port: int):
        first = await handshake("127.0.0.1", port, local_hash=HASH)
        gen["n"] = 7
        second = await handshake("127.0.0.1", port, local_hash=HASH)
        return first, second

    first, second = await _with_server(lambda: _meta(registration_generation=gen["n"]), body)
    assert (first.meta.registration_generation, second.meta.registration_generation) == (0, 7)


async def test_nobody_listening_is_transport_error() -> None:
    from bidir_kv.launch.process import free_port

    port = free_port()
    with pytest.raises(KVTransportError, match=f"127.0.0.1:{port}"):
        await handshake("127.0.0.1", port, local_hash=HASH, timeout=2.0)


async def test_silent_peer_times_out() -> None:
    async def body() -> None:
        conns: list[asyncio.StreamWriter] = []

        async def mute(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            conns.append(w)

        server = await asyncio.start_server(mute, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await handshake("127.0.0.1", port, local_hash=HASH, timeout=0.2)
        finally:
            for w in conns:
                w.close()
            server.close()
            await server.wait_closed()

    with pytest.raises(KVTransportError, match=r"timed out after 0\.2 s"):
        await body()


async def test_metadata_unavailable_is_reported() -> None:
    def broken() -> EngineMetadata:
        raise RuntimeError("re-registering")

    async def body(port: int):
        return await handshake("127.0.0.1", port, local_hash=HASH)

    with pytest.raises(KVTransportError, match="metadata unavailable: re-registering"):
        await _with_server(broken, body)


def test_env_address_defaults_and_errors() -> None:
    assert side_channel_address({}) == ("localhost", 5600)
    assert side_channel_address(
        {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5701"}
    ) == ("127.0.0.1", 5701)
    with pytest.raises(ValueError, match="must be an integer"):
        side_channel_address({"VLLM_NIXL_SIDE_CHANNEL_PORT": "x"})


def test_metadata_wire_rejects_missing_field() -> None:
    wire = _meta().to_wire()
    del wire["block_nbytes"]
    with pytest.raises(KVTransportError, match="lacks 'block_nbytes'"):
        EngineMetadata.from_wire(wire)
