"""The one SSE reader: ``data:`` payloads out of a byte stream, sync or async.

A response body arrives in network-sized pieces that cut lines anywhere; this module
only re-joins lines and hands them to :func:`bidir_kv.protocol.iter_sse_data`, which
stays the one reader of the ``data:`` framing. What a payload means is
:class:`bidir_kv.client.result.StreamReader`'s business.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

from bidir_kv.protocol import iter_sse_data

__all__ = ["aiter_data", "iter_data"]


def iter_data(pieces: Iterable[bytes]) -> Iterator[bytes]:
    """Payloads of the ``data:`` lines in a body given as byte pieces."""
    buf = b""
    for piece in pieces:
        buf += piece
        if b"\n" not in piece:
            continue
        *lines, buf = buf.split(b"\n")
        yield from iter_sse_data(lines)
    if buf:
        yield from iter_sse_data([buf])


async def aiter_data(pieces: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """:func:`iter_data` over an async byte stream."""
    buf = b""
    async for piece in pieces:
        buf += piece
        if b"\n" not in piece:
            continue
        *lines, buf = buf.split(b"\n")
        for data in iter_sse_data(lines):
            yield data
    if buf:
        for data in iter_sse_data([buf]):
            yield data
