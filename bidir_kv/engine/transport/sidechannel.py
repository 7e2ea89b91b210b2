"""The side channel: how a reader learns a peer engine's transport metadata and clock.

Every engine listens on ``VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT``.
A reader connects, asks for the metadata once and pings a few more times; each answer
carries the responder's ``time.perf_counter()``, and the lowest-RTT sample gives the
clock offset that P uses to judge D's ``remote_blocks_expiry_time`` (docs/protocol.md §5.3).

The role matches vLLM's ZMQ side channel, but the wire is our own (length-prefixed
msgpack over plain TCP; names and version in :mod:`.wire`, drawn in ``docs/transports.md``):
it is not wire-compatible with vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import bidir_kv
from bidir_kv.engine.transport import wire
from bidir_kv.engine.transport.base import KVTransportError
from bidir_kv.engine.transport.framing import checked_map, read_frame, write_frame
from bidir_kv.policy import HandshakeSample, clock_offset
from bidir_kv.wire import versions
from bidir_kv.wire.ids import EngineId
from bidir_kv.wire.ports import DEFAULT_SIDE_CHANNEL_PORT

__all__ = [
    "DEFAULT_SIDE_CHANNEL_HOST",
    "EngineMetadata",
    "PeerInfo",
    "SideChannelServer",
    "compatibility_hash",
    "handshake",
    "side_channel_address",
]

logger = logging.getLogger("bidir_kv.engine.transport")

DEFAULT_SIDE_CHANNEL_HOST = "localhost"
DEFAULT_SAMPLES = 3


def side_channel_address(env: Mapping[str, str]) -> tuple[str, int]:
    """``(host, port)`` from ``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT`` with vLLM's defaults."""
    host = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or DEFAULT_SIDE_CHANNEL_HOST
    raw = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT") or str(DEFAULT_SIDE_CHANNEL_PORT)
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"VLLM_NIXL_SIDE_CHANNEL_PORT must be an integer, got {raw!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"VLLM_NIXL_SIDE_CHANNEL_PORT out of range: {port}")
    return host, port


def compatibility_hash(
    extra: Mapping[str, Any] | None = None,
    *,
    version: str = bidir_kv.__version__,
    connector_version: int = versions.TRANSPORT.version,
) -> str:
    """SHA-256 over our version, the wire version and engine facts (``extra``).

    Like vLLM's hash, two engines only exchange KV when they agree on everything
    that shapes the bytes; pass e.g. model name, block size and KV bytes per token.
    """
    factors = {"bidir_kv": version, "connector_version": connector_version, **(extra or {})}
    text = json.dumps(factors, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class EngineMetadata:
    """What an engine tells a reader about itself."""

    engine_id: EngineId
    compat_hash: str
    backend: str  # the transport: wire.TCP or wire.NIXL (KVAgent.backend)
    agent_metadata: bytes  # KVAgent.metadata()
    block_size: int  # tokens per block
    block_nbytes: int  # bytes per block (all layers)
    num_blocks: int
    registration_generation: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "compat_hash": self.compat_hash,
            "backend": self.backend,
            "agent_metadata": self.agent_metadata,
            "block_size": self.block_size,
            "block_nbytes": self.block_nbytes,
            "num_blocks": self.num_blocks,
            "registration_generation": self.registration_generation,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> EngineMetadata:
        md = checked_map(obj, _META_FIELDS, "handshake metadata")
        return cls(**{k: md[k] for k in _META_FIELDS})


_META_FIELDS: dict[str, type] = {
    "engine_id": str,
    "compat_hash": str,
    "backend": str,
    "agent_metadata": bytes,
    "block_size": int,
    "block_nbytes": int,
    "num_blocks": int,
    "registration_generation": int,
}


@dataclass(frozen=True)
class PeerInfo:
    """A successful handshake: the peer's metadata and our view of its clock."""

    host: str
    port: int
    meta: EngineMetadata
    samples: tuple[HandshakeSample, ...] = field(repr=False)
    offset: float  # peer clock - our clock (seconds), from the lowest-RTT sample

    @property
    def engine_id(self) -> EngineId:
        return self.meta.engine_id

    @property
    def rtt(self) -> float:
        return min(s.rtt for s in self.samples)


class SideChannelServer:
    """Answers ``get_meta`` and ``ping`` on ``host:port``; the engine owns its lifetime.

    ``metadata`` is called per request so a re-registration (new generation) is seen
    by the next handshake without restarting the listener.
    """

    def __init__(
        self,
        host: str,
        port: int,
        metadata: Callable[[], EngineMetadata],
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.host = host
        self.port = port
        self._metadata = metadata
        self._clock = clock
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
        except OSError as exc:
            raise KVTransportError(
                f"side channel cannot listen on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from None
        sock = self._server.sockets[0]
        self.port = int(sock.getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._conns):
                task.cancel()
            for task in list(self._conns):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns.add(task)
        try:
            while True:
                try:
                    req = await read_frame(reader)
                except KVTransportError as exc:
                    logger.warning("side channel: dropping connection: %s", exc)
                    return
                if req is None:
                    return
                await write_frame(writer, self._answer(req))
        except (ConnectionError, OSError):
            return
        finally:
            if task is not None:
                self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _answer(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get(wire.OP)
        version = req.get(wire.VERSION)
        if version != versions.TRANSPORT.version:
            return wire.refuse(f"unsupported side-channel version {version!r}")
        if op == wire.OP_GET_META:
            try:
                meta = self._metadata().to_wire()
            except Exception as exc:  # the engine is not ready (e.g. re-registering)
                return wire.refuse(f"metadata unavailable: {exc}")
            return wire.accept({wire.META: meta, wire.NOW: self._clock()})
        if op == wire.OP_PING:
            return wire.accept({wire.NOW: self._clock()})
        return wire.refuse(f"unknown side-channel op {op!r}")


async def _exchange(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    op: str,
    clock: Callable[[], float],
) -> tuple[dict[str, Any], HandshakeSample]:
    send = clock()
    await write_frame(writer, {wire.OP: op, wire.VERSION: versions.TRANSPORT.version})
    resp = await read_frame(reader)
    recv = clock()
    if resp is None:
        raise KVTransportError("side channel closed the connection without answering")
    refused = wire.refusal(resp)
    if refused is not None:
        raise KVTransportError(f"side channel refused {op}: {refused}")
    now = resp.get(wire.NOW)
    if not isinstance(now, float | int) or isinstance(now, bool):
        raise KVTransportError(f"side channel answer lacks a clock reading: {now!r}")
    return resp, HandshakeSample(send=send, recv=recv, remote_now=float(now))


async def handshake(
    host: str,
    port: int,
    *,
    local_hash: str,
    enforce_compat: bool = True,
    expected_engine_id: str | None = None,
    backend: str | None = None,
    samples: int = DEFAULT_SAMPLES,
    timeout: float = 5.0,
    clock: Callable[[], float] = time.perf_counter,
) -> PeerInfo:
    """Fetch a peer's metadata, check compatibility, and estimate its clock offset.

    Raises :class:`KVTransportError` on timeout, refusal, a hash mismatch (unless
    ``enforce_compat`` is false), an engine-id mismatch or, when ``backend`` (our
    transport, ``KVAgent.backend``) is given, a peer speaking another transport.
    """
    if samples < 1:
        raise ValueError(f"handshake needs at least one sample, got {samples}")
    where = f"{host}:{port}"

    async def run() -> tuple[EngineMetadata, list[HandshakeSample]]:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            resp, first = await _exchange(reader, writer, wire.OP_GET_META, clock)
            got = [first]
            for _ in range(samples - 1):
                _, s = await _exchange(reader, writer, wire.OP_PING, clock)
                got.append(s)
            return EngineMetadata.from_wire(resp.get(wire.META)), got
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    try:
        meta, got = await asyncio.wait_for(run(), timeout)
    except TimeoutError:
        raise KVTransportError(
            f"side-channel handshake with {where} timed out after {timeout} s"
        ) from None
    except OSError as exc:
        raise KVTransportError(
            f"side-channel handshake with {where} failed: {exc.strerror or exc}"
        ) from None
    except KVTransportError as exc:
        raise KVTransportError(f"side-channel handshake with {where} failed: {exc}") from None

    if meta.compat_hash != local_hash:
        if enforce_compat:
            raise KVTransportError(
                f"compatibility hash mismatch with engine {meta.engine_id} at {where}: "
                f"remote {meta.compat_hash}, local {local_hash} "
                "(set enforce_handshake_compat to false to override)"
            )
        logger.warning(
            "Ignoring compatibility hash mismatch with engine %s (remote %s, local %s) "
            "because enforce_handshake_compat is false",
            meta.engine_id,
            meta.compat_hash,
            local_hash,
        )
    else:
        logger.info("NIXL compatibility check passed (hash: %s)", meta.compat_hash)
    if expected_engine_id is not None and meta.engine_id != expected_engine_id:
        raise KVTransportError(
            f"engine id mismatch at {where}: expected {expected_engine_id}, "
            f"peer is {meta.engine_id}"
        )
    if backend is not None and meta.backend != backend:
        raise KVTransportError(
            f"transport mismatch with engine {meta.engine_id}: "
            f"peer uses {meta.backend}, we use {backend}"
        )
    return PeerInfo(host=host, port=port, meta=meta, samples=tuple(got), offset=clock_offset(got))
