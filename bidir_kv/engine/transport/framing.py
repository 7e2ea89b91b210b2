"""Encoding of our wire: length-prefixed msgpack frames and agent metadata blobs.

A frame (``wire.FRAME_HEADER``) is a 4-byte big-endian unsigned length followed by that
many bytes of one msgpack map: the control encoding of the side channel and the TCP
transport. Bulk KV bytes never go through msgpack: the TCP transport sends them raw
right after a header frame that announces their size.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import msgpack

from bidir_kv.engine.transport import wire
from bidir_kv.engine.transport.base import KVTransportError
from bidir_kv.wire import versions

__all__ = [
    "checked_map",
    "decode",
    "decode_agent_metadata",
    "encode",
    "encode_agent_metadata",
    "read_frame",
    "sock_read_frame",
    "sock_recv_into",
    "sock_write_frame",
    "write_frame",
]


def encode(obj: dict[str, Any]) -> bytes:
    """One frame (header + body) for ``obj``."""
    body = msgpack.packb(obj, use_bin_type=True)
    if len(body) > wire.MAX_FRAME:
        raise KVTransportError(
            f"frame of {len(body)} bytes exceeds the {wire.MAX_FRAME}-byte limit"
        )
    return wire.FRAME_HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict[str, Any]:
    """The msgpack map in a frame body; anything else is a protocol error."""
    try:
        obj = msgpack.unpackb(body, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise KVTransportError(f"malformed frame: {exc}") from None
    if not isinstance(obj, dict):
        raise KVTransportError(f"frame is not a map: {type(obj).__name__}")
    return obj


def checked_map(obj: Any, kinds: dict[str, type], what: str) -> dict[str, Any]:
    """``obj`` as a map that has every key of ``kinds`` with that type (bools are not ints)."""
    if not isinstance(obj, dict):
        raise KVTransportError(f"{what} is not a map: {type(obj).__name__}")
    for key, kind in kinds.items():
        if key not in obj:
            raise KVTransportError(f"{what} lacks {key!r}")
        value = obj[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise KVTransportError(f"{what} field {key!r} has type {type(value).__name__}")
    return obj


def encode_agent_metadata(transport: str, fields: dict[str, Any]) -> bytes:
    """An agent's ``metadata()`` blob: its transport tag, the wire version, ``fields``."""
    return msgpack.packb(
        {wire.TRANSPORT: transport, wire.VERSION: versions.TRANSPORT.version, **fields},
        use_bin_type=True,
    )


def decode_agent_metadata(
    metadata: bytes, transport: str, kinds: dict[str, type], block_nbytes: int
) -> dict[str, Any]:
    """A peer agent's ``metadata()`` blob, checked: right transport, wire version,
    field types, and the same block size as ours (rows are copied whole)."""
    label = transport.upper()
    try:
        raw = msgpack.unpackb(metadata, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise KVTransportError(f"malformed {label} agent metadata: {exc}") from None
    if not isinstance(raw, dict) or raw.get(wire.TRANSPORT) != transport:
        raise KVTransportError(f"peer metadata is not from a {label} agent")
    version = raw.get(wire.VERSION)
    if version != versions.TRANSPORT.version:
        raise KVTransportError(f"{label} agent metadata version {version!r} unsupported")
    md = checked_map(raw, kinds, f"{label} agent metadata")
    if md["block_nbytes"] != block_nbytes:
        raise KVTransportError(
            f"peer {md['name']} has {md['block_nbytes']}-byte blocks, ours are {block_nbytes} bytes"
        )
    return md


def _check_length(n: int) -> int:
    if n > wire.MAX_FRAME:
        raise KVTransportError(f"peer announced a {n}-byte frame (limit {wire.MAX_FRAME})")
    return n


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """Next frame from a stream, or ``None`` on a clean end of stream between frames."""
    try:
        header = await reader.readexactly(wire.FRAME_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise KVTransportError("connection closed inside a frame header") from None
    (n,) = wire.FRAME_HEADER.unpack(header)
    try:
        body = await reader.readexactly(_check_length(n))
    except asyncio.IncompleteReadError:
        raise KVTransportError("connection closed inside a frame body") from None
    return decode(body)


async def write_frame(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    writer.write(encode(obj))
    await writer.drain()


async def sock_recv_into(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview
) -> None:
    """Fill ``view`` completely from ``sock`` (zero-copy into the caller's buffer)."""
    got = 0
    total = len(view)
    while got < total:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise KVTransportError(f"connection closed after {got} of {total} bytes")
        got += n


async def sock_read_frame(
    loop: asyncio.AbstractEventLoop, sock: socket.socket
) -> dict[str, Any] | None:
    """Next frame from a raw socket, or ``None`` on a clean close between frames."""
    header = bytearray(wire.FRAME_HEADER.size)
    n = await loop.sock_recv_into(sock, header)
    if n == 0:
        return None
    if n < len(header):
        await sock_recv_into(loop, sock, memoryview(header)[n:])
    (size,) = wire.FRAME_HEADER.unpack(header)
    body = bytearray(_check_length(size))
    await sock_recv_into(loop, sock, memoryview(body))
    return decode(bytes(body))


async def sock_write_frame(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, obj: dict[str, Any]
) -> None:
    await loop.sock_sendall(sock, encode(obj))
