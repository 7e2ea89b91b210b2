"""The router's listener (bidir_kv/router/listener.py) in this process: a request head
whose blank line arrives split over reads of one to three bytes ends the head deadline
(the connection is served, not closed at --header-timeout), and every closed connection
frees its slot of --max-connections. The slow-client cases against a router process
are in suites/integration/test_router_clients.py."""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from aiohttp import web

from bidir_kv.router.listener import GuardedConnection, Listener
from bidir_kv.router.metrics import RouterMetrics
from bidir_kv.testing.poll import wait_for_async

pytestmark = pytest.mark.unit

HEAD = b"GET /health HTTP/1.1\r\nHost: router\r\nUser-Agent: slow-client\r\n\r\n"


class _Transport(asyncio.Transport):
    """Records the listener's close (the head deadline's only action on a connection)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = asyncio.Event()

    def close(self) -> None:
        self.closed.set()

    def is_closing(self) -> bool:
        return self.closed.is_set()


class _Inner(asyncio.Protocol):
    """Stands in for aiohttp's request handler: keeps what it is handed."""

    def __init__(self) -> None:
        self.data = b""

    def data_received(self, data: bytes) -> None:
        self.data += data


def _listener(header_timeout: float) -> Listener:
    return Listener(
        cast(Any, None),  # accept() is not used here: connections are handed in directly
        _Inner,
        max_connections=8,
        header_timeout=header_timeout,
        metrics=RouterMetrics(),
    )


def _count(listener: Listener, name: str) -> float | None:
    return listener.metrics.registry.get_sample_value(f"bidir_kv_router_{name}_total")


def _open(listener: Listener) -> tuple[GuardedConnection, _Inner, _Transport]:
    inner, transport = _Inner(), _Transport()
    conn = GuardedConnection(inner, listener)
    conn.connection_made(transport)
    return conn, inner, transport


@pytest.mark.parametrize(
    ("size", "shift"),
    [(1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)],
    ids=lambda v: str(v),
)
async def test_a_head_split_into_reads_of_one_to_three_bytes_is_served(
    size: int, shift: int
) -> None:
    """``size``-byte reads, the first ``shift`` bytes shorter, so the blank line
    ``\\r\\n\\r\\n`` is cut at every place a read boundary can cut it."""
    listener = _listener(header_timeout=0.2)
    conn, inner, transport = _open(listener)
    cuts = [0, *range(shift or size, len(HEAD), size), len(HEAD)]
    for a, b in itertools.pairwise(cuts):
        conn.data_received(HEAD[a:b])
    assert inner.data == HEAD
    # a second connection opened now, that never sends its head: once its deadline has
    # closed it, the first one's (earlier) deadline has passed too
    _, _, canary = _open(listener)
    await asyncio.wait_for(canary.closed.wait(), timeout=30)
    assert not transport.closed.is_set(), "a whole head was closed at --header-timeout"
    assert _count(listener, "header_timeouts") == 1  # the canary's only


async def _hello(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.fixture
async def served() -> AsyncIterator[tuple[Listener, int]]:
    """A real Listener with --max-connections 2 in front of a one-route aiohttp app."""
    app = web.Application()
    app.router.add_get("/health", _hello)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    assert runner.server is not None
    sock = socket.create_server(("127.0.0.1", 0))
    listener = Listener(
        sock,
        runner.server,
        max_connections=2,
        header_timeout=30,
        metrics=RouterMetrics(),
    )
    accepting = asyncio.create_task(listener.serve())
    try:
        yield listener, sock.getsockname()[1]
    finally:
        accepting.cancel()
        await runner.cleanup()
        sock.close()


async def _ask(port: int, *, close_by: str) -> bytes:
    """One request; the router closes the connection (``Connection: close``) or the
    client does once it has the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        extra = b"Connection: close\r\n" if close_by == "router" else b""
        writer.write(b"GET /health HTTP/1.1\r\nHost: router\r\n" + extra + b"\r\n")
        if close_by == "router":
            return await reader.read()  # to EOF: the router closed its side
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        return head + await reader.readexactly(length)
    finally:
        writer.close()


async def test_every_closed_connection_frees_its_slot(served: tuple[Listener, int]) -> None:
    listener, port = served
    for i in range(5):  # more sequential connections than --max-connections (2)
        answer = await _ask(port, close_by="router" if i % 2 else "client")
        assert answer.startswith(b"HTTP/1.1 200"), (i, answer[:200])
        await wait_for_async(lambda: listener.open == 0, timeout=10, what="the slot freed")
    answer = await _ask(port, close_by="router")
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert _count(listener, "connections_refused") == 0
