"""Accepting client connections: a bound on how many are open, a deadline on a new
connection's request head, a reserve of descriptors, and a clear answer to every
connection the router cannot serve.

The router accepts on its own loop (``loop.sock_accept``) and hands each connection to
aiohttp's protocol through :class:`GuardedConnection`, instead of ``loop.create_server``:

- **Open connections are bounded** by a :class:`DescriptorBudget`, computed once from the
  process's descriptor limit (``ulimit -n``) and the descriptors already open: each
  client connection with a turn in flight also holds an engine connection, and
  ``RESERVE`` descriptors are never given to clients (the spare below, lingering
  refusals, reconnects). ``--max-connections`` lowers the bound; one above what the
  descriptor limit can hold is lowered to it, with a WARNING naming both.
- **One past the bound** gets a ``503`` with a JSON error naming the bound and where it
  comes from, and ``Connection: close``, written straight to the socket (no handler,
  no request parsing). The connection then *lingers*: the router stops writing and
  reads and discards what the client still sends, until the client closes or
  ``LINGER_IDLE_S`` pass without data (``LINGER_MAX_S`` at most). Closing a socket with
  unread input sends a reset, and a client still writing its request then sees
  ``ECONNRESET`` instead of the answer. At most ``LINGER_SLOTS`` connections linger at
  once (each holds a descriptor of the reserve); further ones wait in the kernel's
  backlog for a slot.
- **A new connection must send its request head within ``--header-timeout``** (the
  blank line ending its headers), else it is closed. A connection that sends nothing,
  or drips a partial request, holds a descriptor and a slot of the bound only that long.
  Between requests on a kept-alive connection, aiohttp's keep-alive timeout
  (``--idle-timeout``) closes a connection with no request in progress.
- **Out of descriptors** all the same (``EMFILE``/``ENFILE`` on accept, e.g. engine
  connections took the reserve): the listener closes its *spare* descriptor (opened at
  start for this), accepts one waiting connection with it, answers it ``503`` naming the
  descriptor limit, closes it and opens the spare again. Without a spare (it could not
  be reopened), connections wait in the kernel's backlog and accepting resumes after
  ``ACCEPT_RETRY_S``. One WARNING line per ``EMFILE_LOG_EVERY_S`` says so, with how many
  failures it stands for. (The loop's own server would stop listening for good under
  uvloop, which closes its listener on any accept error, and libuv resets the pending
  connections.)
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from bidir_kv.router.metrics import RouterMetrics

__all__ = [
    "ACCEPT_RETRY_S",
    "EMFILE_LOG_EVERY_S",
    "LINGER_IDLE_S",
    "LINGER_MAX_S",
    "LINGER_SLOTS",
    "RESERVE",
    "DescriptorBudget",
    "GuardedConnection",
    "Listener",
    "descriptor_budget",
    "open_descriptors",
]

log = logging.getLogger("bidir_kv.router")

ACCEPT_RETRY_S = 0.05  # pause before accepting again once descriptors ran out
EMFILE_LOG_EVERY_S = 10.0  # at most one "out of descriptors" line this often
# Lingering refusals (Apache's lingering close reads for 2 s at a time, nginx's
# lingering_timeout is 5 s): a client that has read its 503 closes at once.
LINGER_SLOTS = 8
LINGER_IDLE_S = 0.5
LINGER_MAX_S = 5.0
# descriptors never given to client connections: the spare, the lingering refusals,
# and three for reconnects (a store, a log file) while the bound is reached
RESERVE = 1 + LINGER_SLOTS + 3
UNLIMITED_NOFILE = 65536  # what an unlimited RLIMIT_NOFILE is counted as
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_HEAD_END = b"\r\n\r\n"


@dataclass(frozen=True)
class DescriptorBudget:
    """How many client connections the router serves at once, and why that many.

    ``limit`` names where the bound comes from, as a 503 and the start-up line say it;
    ``lowered_from`` is a ``--max-connections`` the descriptor limit cannot hold."""

    bound: int
    limit: str
    nofile: int
    in_use: int
    lowered_from: int | None = None


def descriptor_budget(
    requested: int | None, nofile: int, in_use: int, held_elsewhere: int = 0
) -> DescriptorBudget:
    """The client-connection bound for a process allowed ``nofile`` descriptors with
    ``in_use`` open now and ``held_elsewhere`` more to come (a store's pool).

    Each client connection with a turn in flight also holds an engine connection, so
    clients get half of what is left after those and :data:`RESERVE`; an explicit
    ``requested`` bound may only lower that."""
    taken = in_use + held_elsewhere + RESERVE
    fits = max(1, (nofile - taken) // 2)
    derived = (
        f"half of what ulimit -n {nofile} leaves after {taken} descriptors in use or "
        "in reserve; each turn in flight also holds an engine connection"
    )
    if requested is None:
        return DescriptorBudget(fits, derived, nofile, in_use)
    if requested <= fits:
        return DescriptorBudget(requested, f"--max-connections {requested}", nofile, in_use)
    return DescriptorBudget(
        fits, f"--max-connections {requested} lowered to {derived}", nofile, in_use, requested
    )


def open_descriptors() -> int:
    """Descriptors this process has open (``/proc/self/fd``; ``/dev/fd`` elsewhere)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(folder)) - 1  # the listing's own descriptor
    return 0


def nofile_limit() -> int:
    """The soft ``RLIMIT_NOFILE`` (an unlimited one counted as :data:`UNLIMITED_NOFILE`)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return UNLIMITED_NOFILE if soft == resource.RLIM_INFINITY else int(soft)


def _answer_503(message: str) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": "ServiceUnavailable", "code": 503}}
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
    """Accept on ``sock`` until cancelled; each connection gets ``factory()``'s protocol.

    ``budget``: the bound on open client connections and how it came to be (see
    :func:`descriptor_budget`; the router's CLI builds it once it has started)."""

    def __init__(
        self,
        sock: socket.socket,
        factory: Callable[[], asyncio.Protocol],
        *,
        budget: DescriptorBudget,
        header_timeout: float,
        metrics: RouterMetrics,
        linger_idle: float = LINGER_IDLE_S,
        linger_max: float = LINGER_MAX_S,
    ) -> None:
        self.sock = sock
        self.factory = factory
        self.budget = budget
        self.linger_idle, self.linger_max = linger_idle, linger_max
        self.header_timeout = header_timeout
        self.metrics = metrics
        self.open = 0
        self._busy = _answer_503(
            f"the router has {budget.bound} client connections open, as many as its "
            f"limit allows ({budget.limit}); retry shortly"
        )
        self._starved = _answer_503(
            f"the router is out of file descriptors (ulimit -n {budget.nofile}); retry shortly"
        )
        self._last_emfile_log = -EMFILE_LOG_EVERY_S
        self._unlogged = 0
        self._spare: int | None = None
        self._linger_slots = asyncio.Semaphore(LINGER_SLOTS)
        self._lingering: set[asyncio.Task[None]] = set()

    @property
    def max_connections(self) -> int:
        return self.budget.bound

    def opened(self) -> None:
        self.open += 1
        self.metrics.client_connections.set(self.open)

    def closed(self) -> None:
        self.open -= 1
        self.metrics.client_connections.set(self.open)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self.sock.setblocking(False)
        self._spare = _open_spare()
        try:
            await self._accept_loop(loop)
        finally:
            for task in list(self._lingering):
                task.cancel()
            if self._spare is not None:
                os.close(self._spare)
                self._spare = None

    async def _accept_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    self._out_of_descriptors(exc)
                    if not self._answer_from_reserve():
                        await asyncio.sleep(ACCEPT_RETRY_S)  # pacing: the backlog holds them
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    continue
                raise
            if self._spare is None:  # given up when descriptors ran out: take it back
                self._spare = _open_spare()
            if self.open >= self.budget.bound:
                # the slot is taken before the check again: a connection that closed
                # meanwhile makes room, and this one is served instead
                await self._linger_slots.acquire()
                if self.open >= self.budget.bound:
                    self._refuse(conn, self._busy)
                    continue
                self._linger_slots.release()
            try:
                await loop.connect_accepted_socket(
                    lambda: GuardedConnection(self.factory(), self), sock=conn
                )
            except OSError:  # gone before it was set up
                conn.close()

    def _refuse(self, conn: socket.socket, answer: bytes) -> None:
        """Answer ``conn`` with ``answer`` and let it linger (holding a linger slot)."""
        self.metrics.connections_refused.inc()
        try:
            conn.setblocking(False)
            conn.send(answer)  # a few hundred bytes: a new socket's buffer takes them
        except OSError:
            conn.close()
            self._linger_slots.release()
            return
        task = asyncio.get_running_loop().create_task(self._linger(conn))
        self._lingering.add(task)
        task.add_done_callback(self._lingering.discard)

    async def _linger(self, conn: socket.socket) -> None:
        """Stop writing, read and drop what the client still sends until it closes or
        goes quiet, then close: a close with unread input would reset the connection
        under a client still writing its request."""
        loop = asyncio.get_running_loop()
        try:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)
            deadline = loop.time() + self.linger_max
            while (left := deadline - loop.time()) > 0:
                try:
                    data = await asyncio.wait_for(
                        loop.sock_recv(conn, 65536), min(self.linger_idle, left)
                    )
                except (TimeoutError, OSError):
                    break
                if not data:
                    break
        finally:
            conn.close()
            self._linger_slots.release()

    def _answer_from_reserve(self) -> bool:
        """Out of descriptors: accept one waiting connection with the spare descriptor and
        answer it 503 naming the limit. False when there is no spare to use."""
        if self._spare is None:
            return False
        os.close(self._spare)
        self._spare = None
        try:
            conn, _ = self.sock.accept()
        except OSError:  # none waiting (BlockingIOError), or taken by another thread
            self._spare = _open_spare()
            return self._spare is not None
        self.metrics.connections_refused.inc()
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            conn.send(self._starved)
            _drain(conn)
            conn.shutdown(socket.SHUT_WR)
        conn.close()  # no lingering: its descriptor is the spare's
        self._spare = _open_spare()
        return True

    def _out_of_descriptors(self, exc: OSError) -> None:
        self.metrics.accept_failures.labels(errno.errorcode.get(exc.errno or 0, "?")).inc()
        now = time.monotonic()
        self._unlogged += 1
        if now - self._last_emfile_log < EMFILE_LOG_EVERY_S:
            return
        log.warning(
            "cannot accept client connections: %s (%d accept failures since the "
            "last such line; %d client connections open, ulimit -n %d); %s. Raise the "
            "descriptor limit (ulimit -n) or lower --max-connections",
            exc.strerror or exc,
            self._unlogged,
            self.open,
            self.budget.nofile,
            "waiting connections are answered 503 from the reserve"
            if self._spare is not None
            else "new connections wait in the backlog",
        )
        self._last_emfile_log = now
        self._unlogged = 0


def _open_spare() -> int | None:
    """The spare descriptor (``/dev/null``), or None when none is free."""
    try:
        return os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return None


def _drain(conn: socket.socket) -> None:
    """Read what ``conn`` has received so far (non-blocking), so that closing it sends
    a FIN, not a reset."""
    with contextlib.suppress(OSError):
        while conn.recv(65536):
            pass
