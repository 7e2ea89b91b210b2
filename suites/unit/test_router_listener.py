"""The router's listener (bidir_kv/router/listener.py) in this process: a request head
whose blank line arrives split over reads of one to three bytes ends the head deadline
(the connection is served, not closed at --header-timeout), every closed connection
frees its slot of the bound, the descriptor budget, a refusal that lingers instead of
resetting, and the spare descriptor that answers when accept runs out of descriptors
(real sockets on loopback; only the ``EMFILE`` of an accept is injected, a socket whose
next accept fails as the kernel's would). The slow-client cases against a router
process are in suites/integration/test_router_clients.py."""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import pytest
from aiohttp import web

from bidir_kv.router.listener import (
    RESERVE,
    DescriptorBudget,
    GuardedConnection,
    Listener,
    descriptor_budget,
)
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
        budget=DescriptorBudget(8, "--max-connections 8", 128, 15),
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
    ``\\r\\n\\r\\n`` is cut at every place a read boundary can cut it. The reads are
    handed in without yielding to the loop, so the deadline cannot fire before the last
    one whatever its length: a short one only makes the canary's wait short."""
    listener = _listener(header_timeout=0.02)
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
        budget=DescriptorBudget(2, "--max-connections 2", 128, 15),
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


# ---- the descriptor budget, lingering refusals, the spare ----------------------------


def test_default_bound_is_half_of_what_the_limit_leaves() -> None:
    b = descriptor_budget(None, nofile=128, in_use=15)
    assert b.bound == (128 - 15 - RESERVE) // 2
    assert "ulimit -n 128" in b.limit and b.lowered_from is None
    # a store's pool comes out of the same limit
    assert descriptor_budget(None, 128, 15, held_elsewhere=20).bound == (128 - 35 - RESERVE) // 2


def test_an_explicit_bound_may_only_lower_it() -> None:
    assert descriptor_budget(10, 128, 15) == DescriptorBudget(10, "--max-connections 10", 128, 15)
    high = descriptor_budget(1000, 128, 15)
    assert high.bound == (128 - 15 - RESERVE) // 2 and high.lowered_from == 1000
    assert high.limit.startswith("--max-connections 1000 lowered to half of what ulimit -n 128")


def test_a_limit_below_what_is_in_use_still_serves_one() -> None:
    assert descriptor_budget(None, 16, 15).bound == 1


class _Served(asyncio.Protocol):
    """A served connection: answers its first bytes with ``OK`` and closes."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(b"OK")
        self.transport.close()


class _FailingOnce(socket.socket):
    """A listening socket whose next ``accept`` fails with ``EMFILE`` (then works)."""

    fail_next = False

    def accept(self) -> tuple[socket.socket, object]:
        if self.fail_next:
            self.fail_next = False
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


Body = Callable[[Listener, RouterMetrics, int], Awaitable[None]]


async def _with_listener(
    bound: int, body: Body, sock: socket.socket | None = None, linger_max: float = 1.0
) -> None:
    """Run ``body`` against a listener with ``bound`` connections on a loopback port."""
    sock = sock or socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    metrics = RouterMetrics()
    listener = Listener(
        sock,
        _Served,
        budget=DescriptorBudget(bound, f"--max-connections {bound}", 128, 15),
        header_timeout=0,
        metrics=metrics,
        linger_idle=0.2,
        linger_max=linger_max,
    )
    task = asyncio.get_running_loop().create_task(listener.serve())
    try:
        await body(listener, metrics, sock.getsockname()[1])
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        sock.close()


def _count_in(metrics: RouterMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(f"bidir_kv_router_{name}_total", labels) or 0.0


async def _hold_the_only_slot(listener: Listener, port: int) -> asyncio.StreamWriter:
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    async with asyncio.timeout(10):
        while listener.open < 1:
            await asyncio.sleep(0.01)
    return writer


async def _served(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"hello")
    out = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return out


async def test_a_refused_client_still_writing_reads_its_503_not_a_reset() -> None:
    """Past the bound: the 503 comes at once, and the client may go on writing its body
    (the router reads and drops it) and then reads the answer to its end."""

    async def body(listener: Listener, metrics: RouterMetrics, port: int) -> None:
        held = await _hold_the_only_slot(listener, port)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 300000\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        for _ in range(10):  # the router has answered: a close now would reset these
            writer.write(b"x" * 30000)
            await writer.drain()
        rest = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        held.close()
        assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        message = json.loads(rest)["error"]["message"]
        assert "1 client connections open" in message and "--max-connections 1" in message
        assert _count_in(metrics, "connections_refused") == 1

    await _with_listener(1, body)


async def test_a_refusal_lingers_no_longer_than_its_bound() -> None:
    """A refused client that never stops sending is closed after ``linger_max``."""

    async def body(listener: Listener, metrics: RouterMetrics, port: int) -> None:
        held = await _hold_the_only_slot(listener, port)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(
            b"HTTP/1.1 503"
        )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(OSError):  # ConnectionResetError / BrokenPipeError
            while loop.time() - t0 < 10:
                writer.write(b"x" * 1000)
                await writer.drain()
                await asyncio.sleep(0.02)
        assert loop.time() - t0 < 5
        writer.close()
        held.close()

    await _with_listener(1, body, linger_max=0.05)


async def test_out_of_descriptors_a_waiting_client_is_answered_from_the_reserve() -> None:
    sock = _FailingOnce(socket.AF_INET, socket.SOCK_STREAM)

    async def body(listener: Listener, metrics: RouterMetrics, port: int) -> None:
        assert await _served(port) == b"OK"
        sock.fail_next = True
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert b"out of file descriptors (ulimit -n 128)" in answer
        assert _count_in(metrics, "accept_failures", errno="EMFILE") == 1
        assert await _served(port) == b"OK"  # and the next one is served again

    await _with_listener(8, body, sock)
