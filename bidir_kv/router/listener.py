"""Accepting client connections: a bound on how many are open, a deadline on a new
connection's request head, and a listener that survives running out of descriptors.

The router accepts on its own loop (``loop.sock_accept``) and hands each connection to
aiohttp's protocol through :class:`GuardedConnection`, instead of ``loop.create_server``:

- **Open connections are bounded** (``--max-connections``). One past the bound gets a
  ``503`` with a JSON error and ``Connection: close``, written straight to the socket,
  and is closed; no handler, no request parsing.
- **A new connection must send its request head within ``--header-timeout``** (the
  blank line ending its headers), else it is closed. A connection that sends nothing,
  or drips a partial request, holds a descriptor and a slot of the bound only that long.
  Between requests on a kept-alive connection, aiohttp's keep-alive timeout
  (``--idle-timeout``) closes a connection with no request in progress.
- **Out of descriptors** (``EMFILE``/``ENFILE`` on accept): connections wait in the
  kernel's backlog and accepting resumes after ``ACCEPT_RETRY_S``; one WARNING line per
  ``EMFILE_LOG_EVERY_S`` says so, with how many failures it stands for. (The loop's own
  server would stop listening for good under uvloop, which closes its listener on any
  accept error, and libuv resets the pending connections.)
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import socket
import time
from collections.abc import Callable

from bidir_kv.router.metrics import RouterMetrics

__all__ = ["ACCEPT_RETRY_S", "EMFILE_LOG_EVERY_S", "GuardedConnection", "Listener"]

log = logging.getLogger("bidir_kv.router")

ACCEPT_RETRY_S = 0.05  # pause before accepting again once descriptors ran out
EMFILE_LOG_EVERY_S = 10.0  # at most one "out of descriptors" line this often
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_HEAD_END = b"\r\n\r\n"


def _busy_answer(limit: int) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"the router has {limit} client connections open (--max-connections); "
                "retry shortly",
                "type": "ServiceUnavailable",
                "code": 503,
            }
        }
    ).encode()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


class GuardedConnection(asyncio.Protocol):
    """aiohttp's request handler for one connection, behind a request-head deadline."""

    def __init__(self, inner: asyncio.Protocol, listener: Listener) -> None:
        self._inner = inner
        self._listener = listener
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._listener.opened()
        if self._listener.header_timeout > 0:
            self._timer = asyncio.get_running_loop().call_later(
                self._listener.header_timeout, self._head_late
            )
        self._inner.connection_made(transport)

    def _head_late(self) -> None:
        self._timer = None
        self._listener.metrics.header_timeouts.inc()
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            seen = self._tail + data
            if _HEAD_END in seen:
                self._timer.cancel()
                self._timer = None
                self._tail = b""
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._listener.closed()
        self._inner.connection_lost(exc)


class Listener:
    """Accept on ``sock`` until cancelled; each connection gets ``factory()``'s protocol."""

    def __init__(
        self,
        sock: socket.socket,
        factory: Callable[[], asyncio.Protocol],
        *,
        max_connections: int,
        header_timeout: float,
        metrics: RouterMetrics,
    ) -> None:
        self.sock = sock
        self.factory = factory
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.metrics = metrics
        self.open = 0
        self._busy = _busy_answer(max_connections)
        self._last_emfile_log = -EMFILE_LOG_EVERY_S
        self._unlogged = 0

    def opened(self) -> None:
        self.open += 1
        self.metrics.client_connections.set(self.open)

    def closed(self) -> None:
        self.open -= 1
        self.metrics.client_connections.set(self.open)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self.sock.setblocking(False)
        while True:
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    self._out_of_descriptors(exc)
                    await asyncio.sleep(ACCEPT_RETRY_S)  # pacing: the backlog holds them
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    continue
                raise
            if self.open >= self.max_connections:
                self._refuse(conn)
                continue
            try:
                await loop.connect_accepted_socket(
                    lambda: GuardedConnection(self.factory(), self), sock=conn
                )
            except OSError:  # gone before it was set up
                conn.close()

    def _refuse(self, conn: socket.socket) -> None:
        self.metrics.connections_refused.inc()
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            conn.send(self._busy)
        conn.close()

    def _out_of_descriptors(self, exc: OSError) -> None:
        self.metrics.accept_failures.labels(errno.errorcode.get(exc.errno or 0, "?")).inc()
        now = time.monotonic()
        self._unlogged += 1
        if now - self._last_emfile_log < EMFILE_LOG_EVERY_S:
            return
        log.warning(
            "cannot accept client connections: %s (%d accept failures since the "
            "last such line; %d client connections open); new connections wait in "
            "the backlog. Raise the descriptor limit (ulimit -n) or lower "
            "--max-connections",
            exc.strerror or exc,
            self._unlogged,
            self.open,
        )
        self._last_emfile_log = now
        self._unlogged = 0
