"""Frames of the side channel and TCP transport: limits and malformed input."""

from __future__ import annotations

import asyncio
import struct

import msgpack
import pytest

from bidir_kv.engine.transport import KVTransportError
from bidir_kv.engine.transport.framing import decode, encode, read_frame
from bidir_kv.engine.transport.sidechannel import (
    EngineMetadata,
    SideChannelServer,
    compatibility_hash,
    handshake,
)
from bidir_kv.engine.transport.wire import MAX_FRAME


def test_roundtrip_keeps_bytes_and_ints() -> None:
    obj = {"op": "read", "blocks": [0, 7, 2**40], "notif": b"\x00\xffreq:1"}
    frame = encode(obj)
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    assert decode(frame[4:]) == obj


def test_decode_rejects_non_maps_and_garbage() -> None:
    with pytest.raises(KVTransportError, match="not a map"):
        decode(msgpack.packb([1, 2]))
    with pytest.raises(KVTransportError, match="malformed frame"):
        decode(b"\xc1")  # a byte msgpack never uses


async def test_stream_refuses_oversized_and_truncated_frames() -> None:
    async def feed(data: bytes) -> object:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader)

    assert await feed(b"") is None  # clean end between frames
    with pytest.raises(KVTransportError, match="limit"):
        await feed(struct.pack(">I", MAX_FRAME + 1))
    with pytest.raises(KVTransportError, match="inside a frame body"):
        await feed(encode({"op": "ping"})[:-1])
    with pytest.raises(KVTransportError, match="inside a frame header"):
        await feed(b"\x00\x00")


async def test_side_channel_survives_a_garbage_client() -> None:
    chash = compatibility_hash()
    meta = EngineMetadata("e", chash, "tcp", b"", 16, 64, 4)

    async def main() -> str:
        server = SideChannelServer("127.0.0.1", 0, lambda: meta)
        await server.start()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            w.write(struct.pack(">I", 3) + b"\xc1\xc1\xc1")
            await w.drain()
            assert await r.read() == b""  # the server dropped that connection
            w.close()
            r2, w2 = await asyncio.open_connection("127.0.0.1", server.port)
            w2.write(encode({"op": "get_meta", "v": 99}))
            await w2.drain()
            answer = await read_frame(r2)
            w2.close()
            assert answer is not None and not answer["ok"]
            info = await handshake("127.0.0.1", server.port, local_hash=chash)
            return str(answer["error"]) + "|" + info.engine_id
        finally:
            await server.close()

    out = await main()
    assert out == "unsupported side-channel version 99|e"
