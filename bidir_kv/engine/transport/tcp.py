"""A KV transport over plain TCP: real bytes, reader-initiated, notification on completion.

The owner listens on its own data port (published in ``metadata()``); a reader sends
a read request naming block ids and the notification, the owner checks the ids and
streams the rows raw, the reader receives them straight into its pool rows, then says
"done" and the owner hands the notification to its engine. Wire format:
``docs/transports.md``.

Bulk data moves with ``loop.sock_sendall``/``loop.sock_recv_into`` on memoryviews of the
pools, so no per-block Python copies are made; consecutive block ids go as one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from bidir_kv.engine.transport.base import (
    KVAgent,
    KVPool,
    NotificationHandler,
    ReadResult,
    TransportError,
)
from bidir_kv.engine.transport.dispatch import NotificationDispatcher
from bidir_kv.engine.transport.framing import (
    decode_peer_metadata,
    sock_read_frame,
    sock_recv_into,
    sock_write_frame,
)

__all__ = ["TcpAgent", "block_runs"]

logger = logging.getLogger("bidir_kv.engine.transport")

WIRE_VERSION = 1
_SOCK_BUF = 4 * 1024 * 1024
_WILDCARDS = ("", "0.0.0.0", "::")
_MD_FIELDS = {"name": str, "host": str, "port": int, "num_blocks": int, "block_nbytes": int}
_MAX_IDLE = 8  # pooled connections kept per peer after a burst of concurrent reads


def block_runs(blocks: Sequence[int]) -> Iterator[tuple[int, int]]:
    """``(start, count)`` runs of consecutive ids, in order: one syscall stream per run."""
    i = 0
    n = len(blocks)
    while i < n:
        start = blocks[i]
        j = i + 1
        while j < n and blocks[j] == start + (j - i):
            j += 1
        yield start, j - i
        i = j


def _rows(pool: KVPool, start: int, count: int) -> memoryview:
    rows: Any = pool.data[start : start + count].reshape(-1)
    return memoryview(rows)


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)


def _check_ids(ids: Any, num_blocks: int, what: str) -> list[int]:
    if not isinstance(ids, list | tuple):
        raise TransportError(f"{what} block ids must be a list, got {type(ids).__name__}")
    out: list[int] = []
    for b in ids:
        if isinstance(b, bool) or not isinstance(b, int | np.integer):
            raise TransportError(f"{what} block id {b!r} is not an integer")
        if not 0 <= int(b) < num_blocks:
            raise TransportError(
                f"{what} block id {int(b)} out of range for a pool of {num_blocks} blocks"
            )
        out.append(int(b))
    return out


@dataclass
class _Peer:
    name: str
    host: str
    port: int
    num_blocks: int
    block_nbytes: int
    idle: list[socket.socket] = field(default_factory=list)


class TcpAgent(KVAgent):
    """The always-available transport; also the reference the NIXL agent is tested against."""

    backend = "tcp"

    def __init__(
        self,
        name: str,
        pool: KVPool,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        io_timeout: float = 60.0,
    ) -> None:
        super().__init__(name, pool)
        self.host = host
        self.port = port
        self.io_timeout = io_timeout
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._peers: dict[str, _Peer] = {}
        self._dispatch: NotificationDispatcher | None = None

    # -- lifecycle -------------------------------------------------------------------

    async def start(self, on_notification: NotificationHandler) -> None:
        if self._listener is not None:
            raise TransportError(f"agent {self.name} already started")
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        if not infos:
            raise TransportError(f"cannot resolve data host {self.host!r}")
        family, _, _, _, addr = infos[0]
        lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind(addr)
            lsock.listen(64)
        except OSError as exc:
            lsock.close()
            raise TransportError(
                f"TCP transport cannot listen on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from None
        lsock.setblocking(False)
        self._listener = lsock
        self.port = int(lsock.getsockname()[1])
        self._dispatch = NotificationDispatcher(on_notification)
        self._dispatch.start()
        self._spawn(self._accept_loop(lsock))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for peer in self._peers.values():
            for s in peer.idle:
                s.close()
        self._peers.clear()
        if self._dispatch is not None:
            await self._dispatch.close()
            self._dispatch = None

    @property
    def advertised_host(self) -> str:
        """Where peers should connect: the bound host, or our hostname for a wildcard."""
        if self.host in _WILDCARDS:
            return socket.gethostname()
        return self.host

    def metadata(self) -> bytes:
        if self._listener is None:
            raise TransportError(f"agent {self.name} is not started")
        return msgpack.packb(
            {
                "transport": "tcp",
                "v": WIRE_VERSION,
                "name": self.name,
                "host": self.advertised_host,
                "port": self.port,
                "num_blocks": self.pool.num_blocks,
                "block_nbytes": self.pool.block_nbytes,
            },
            use_bin_type=True,
        )

    async def add_peer(self, metadata: bytes) -> str:
        md = decode_peer_metadata(
            metadata, "tcp", WIRE_VERSION, _MD_FIELDS, self.pool.block_nbytes
        )
        old = self._peers.pop(md["name"], None)
        if old is not None:
            for s in old.idle:
                s.close()
        peer = _Peer(
            md["name"], md["host"], int(md["port"]), int(md["num_blocks"]), int(md["block_nbytes"])
        )
        self._peers[peer.name] = peer
        return peer.name

    # -- reader side -----------------------------------------------------------------

    def _peer(self, name: str) -> _Peer:
        try:
            return self._peers[name]
        except KeyError:
            raise TransportError(f"unknown peer {name!r}; add_peer() it first") from None

    async def _connect(self, peer: _Peer, *, fresh: bool = False) -> tuple[socket.socket, bool]:
        """A pooled connection (``reused`` True) or a new one."""
        if peer.idle and not fresh:
            return peer.idle.pop(), True
        loop = asyncio.get_running_loop()
        where = f"peer {peer.name} at {peer.host}:{peer.port}"
        try:
            infos = await loop.getaddrinfo(peer.host, peer.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise TransportError(f"cannot resolve {where}: {exc}") from None
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        _tune(sock)
        try:
            await loop.sock_connect(sock, addr)
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot connect to {where}: {exc.strerror or exc}") from None
        return sock, False

    def _release(self, peer: _Peer, sock: socket.socket) -> None:
        if len(peer.idle) < _MAX_IDLE:
            peer.idle.append(sock)
        else:
            sock.close()

    async def _request(self, peer: _Peer, work: Any) -> Any:
        """Run ``work(sock)`` on a pooled connection; a broken connection is discarded.

        A pooled connection the owner has meanwhile closed (restart, idle close) fails
        before any answer; that case alone is retried once on a fresh connection,
        since the owner cannot have acted on the request.
        """
        fresh = False
        while True:
            sock, reused = await self._connect(peer, fresh=fresh)
            try:
                result = await asyncio.wait_for(work(sock), self.io_timeout)
            except _Stale as exc:
                sock.close()
                if reused and not fresh:
                    fresh = True
                    continue
                raise TransportError(f"transfer with peer {peer.name} failed: {exc}") from None
            except TimeoutError:
                sock.close()
                raise TransportError(
                    f"peer {peer.name} did not complete within {self.io_timeout} s"
                ) from None
            except _Refused as exc:
                self._release(peer, sock)  # refused before streaming: the stream is clean
                raise TransportError(f"peer {peer.name} refused: {exc}") from None
            except (OSError, TransportError) as exc:
                sock.close()
                raise TransportError(f"transfer with peer {peer.name} failed: {exc}") from None
            except BaseException:
                sock.close()
                raise
            self._release(peer, sock)
            return result

    @staticmethod
    async def _first_answer(
        loop: asyncio.AbstractEventLoop, sock: socket.socket, req: dict[str, Any]
    ) -> dict[str, Any]:
        """Send ``req`` and read the first answer; a dead connection is :class:`_Stale`."""
        try:
            await sock_write_frame(loop, sock, req)
            answer = await sock_read_frame(loop, sock)
        except (ConnectionError, TransportError) as exc:
            raise _Stale(str(exc)) from None
        if answer is None:
            raise _Stale("connection closed before the owner answered")
        return answer

    async def read(
        self,
        peer: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        notification: bytes,
    ) -> ReadResult:
        p = self._peer(peer)
        if len(local_blocks) != len(remote_blocks):
            raise TransportError(
                f"read pairs {len(local_blocks)} local with {len(remote_blocks)} remote blocks"
            )
        local = _check_ids(list(local_blocks), self.pool.num_blocks, "local")
        remote = [int(b) for b in remote_blocks]
        nbytes = len(local) * self.pool.block_nbytes
        loop = asyncio.get_running_loop()
        times: dict[str, float] = {}

        req = {"op": "read", "from": self.name, "blocks": remote, "notif": bytes(notification)}

        async def work(sock: socket.socket) -> None:
            t0 = time.perf_counter()
            head = await self._first_answer(loop, sock, req)
            times["post"] = time.perf_counter() - t0
            if not head.get("ok"):
                raise _Refused(str(head.get("error")))
            if head.get("nbytes") != nbytes:
                raise TransportError(
                    f"owner announced {head.get('nbytes')} bytes, expected {nbytes}"
                )
            for start, count in block_runs(local):
                await sock_recv_into(loop, sock, _rows(self.pool, start, count))
            await sock_write_frame(loop, sock, {"op": "done"})
            ack = await sock_read_frame(loop, sock)
            if ack is None or not ack.get("ok"):
                raise TransportError(f"owner did not acknowledge completion: {ack!r}")
            times["xfer"] = time.perf_counter() - t0

        await self._request(p, work)
        return ReadResult(
            bytes=nbytes, descriptors=len(local), post_time=times["post"], xfer_time=times["xfer"]
        )

    async def notify(self, peer: str, message: bytes) -> None:
        p = self._peer(peer)
        loop = asyncio.get_running_loop()

        req = {"op": "notif", "from": self.name, "msg": bytes(message)}

        async def work(sock: socket.socket) -> None:
            ack = await self._first_answer(loop, sock, req)
            if not ack.get("ok"):
                raise _Refused(str(ack.get("error")))

        await self._request(p, work)

    # -- owner side ------------------------------------------------------------------

    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(lsock)
            except OSError:
                return
            _tune(conn)
            self._spawn(self._serve(conn))

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                req = await sock_read_frame(loop, sock)
                if req is None:
                    return
                op = req.get("op")
                if op == "read":
                    await self._serve_read(loop, sock, req)
                elif op == "notif":
                    self._deliver(req.get("from"), req.get("msg"))
                    await sock_write_frame(loop, sock, {"ok": True})
                else:
                    await sock_write_frame(loop, sock, {"ok": False, "error": f"unknown op {op!r}"})
        except (OSError, TransportError) as exc:
            logger.debug("TCP transport: connection dropped: %s", exc)
        finally:
            sock.close()

    def _deliver(self, peer: Any, message: Any) -> None:
        if not isinstance(peer, str) or not isinstance(message, bytes):
            raise TransportError(f"malformed notification from {peer!r}: {message!r}")
        if message and self._dispatch is not None:
            self._dispatch.put(peer, message)

    async def _serve_read(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, req: dict[str, Any]
    ) -> None:
        try:
            blocks = _check_ids(req.get("blocks"), self.pool.num_blocks, "requested")
        except TransportError as exc:
            await sock_write_frame(loop, sock, {"ok": False, "error": str(exc)})
            return
        await sock_write_frame(
            loop, sock, {"ok": True, "nbytes": len(blocks) * self.pool.block_nbytes}
        )
        for start, count in block_runs(blocks):
            await loop.sock_sendall(sock, _rows(self.pool, start, count))
        done = await sock_read_frame(loop, sock)
        if done is None or done.get("op") != "done":
            raise TransportError(f"reader did not confirm the read: {done!r}")
        self._deliver(req.get("from"), req.get("notif"))
        await sock_write_frame(loop, sock, {"ok": True})


class _Refused(Exception):
    """The owner answered with an error before any bulk bytes (connection still clean)."""


class _Stale(Exception):
    """The connection died before the owner answered: the request had no effect."""
