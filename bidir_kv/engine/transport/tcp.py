"""A KV transport over plain TCP: real bytes, reader-initiated, notification on completion.

The owner (:mod:`.tcp_owner`) listens on its own data port, published in ``metadata()``;
a reader sends a read request naming block ids and the notification, receives the rows
straight into its pool rows, then says "done" and the owner hands the notification to
its engine. Messages: :mod:`.wire`; drawn in ``docs/transports.md``.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from bidir_kv.engine.transport import wire
from bidir_kv.engine.transport.base import (
    KVAgent,
    KVPool,
    KVTransportError,
    NotificationHandler,
    ReadResult,
)
from bidir_kv.engine.transport.dispatch import NotificationDispatcher
from bidir_kv.engine.transport.framing import (
    decode_agent_metadata,
    encode_agent_metadata,
    sock_read_frame,
    sock_recv_into,
    sock_write_frame,
)
from bidir_kv.engine.transport.tcp_io import block_runs, check_ids, pool_rows, tune
from bidir_kv.engine.transport.tcp_owner import TcpOwner
from bidir_kv.errors import KVTransferError

__all__ = ["TcpAgent"]

_WILDCARDS = ("", "0.0.0.0", "::")
_MAX_IDLE = 8  # pooled connections kept per peer after a burst of concurrent reads
_T = TypeVar("_T")


@dataclass
class _Peer:
    name: str
    host: str
    port: int
    num_blocks: int
    block_nbytes: int
    idle: list[socket.socket] = field(default_factory=list)
    fence_slots: int = 0  # fence words the owner published (0: none)

    def drop_idle(self) -> None:
        for s in self.idle:
            s.close()
        self.idle.clear()


class TcpAgent(KVAgent):
    """The always-available transport; also the reference the NIXL agent is tested against."""

    backend = wire.TCP

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
        self._owner: TcpOwner | None = None
        self._peers: dict[str, _Peer] = {}
        self._dispatch: NotificationDispatcher | None = None

    # -- lifecycle -------------------------------------------------------------------

    async def start(self, on_notification: NotificationHandler) -> None:
        if self._owner is not None:
            raise KVTransportError(f"agent {self.name} already started")
        dispatch = NotificationDispatcher(on_notification)
        owner = TcpOwner(self.pool, dispatch, self.fence)
        self.port = await owner.listen(self.host, self.port)
        self.fence_registered = self.fence is not None
        self._owner = owner
        self._dispatch = dispatch
        dispatch.start()

    async def close(self) -> None:
        if self._owner is not None:
            await self._owner.close()
            self._owner = None
        for peer in self._peers.values():
            peer.drop_idle()
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
        if self._owner is None:
            raise KVTransportError(f"agent {self.name} is not started")
        fields: dict[str, Any] = {
            "name": self.name,
            "host": self.advertised_host,
            "port": self.port,
            "num_blocks": self.pool.num_blocks,
            "block_nbytes": self.pool.block_nbytes,
        }
        if self.fence_registered and self.fence is not None:
            fields[wire.FENCE_SLOTS] = int(self.fence.shape[0])
        return encode_agent_metadata(wire.TCP, fields)

    async def add_peer(self, metadata: bytes) -> str:
        md = decode_agent_metadata(metadata, wire.TCP, wire.TCP_METADATA, self.pool.block_nbytes)
        old = self._peers.pop(md["name"], None)
        if old is not None:
            old.drop_idle()
        slots = md.get(wire.FENCE_SLOTS)
        peer = _Peer(
            md["name"],
            md["host"],
            int(md["port"]),
            int(md["num_blocks"]),
            int(md["block_nbytes"]),
            fence_slots=slots if isinstance(slots, int) and slots > 0 else 0,
        )
        self._peers[peer.name] = peer
        return peer.name

    # -- reader side -----------------------------------------------------------------

    def _peer(self, name: str) -> _Peer:
        try:
            return self._peers[name]
        except KeyError:
            raise KVTransportError(f"unknown peer {name!r}; add_peer() it first") from None

    async def _connect(self, peer: _Peer, *, fresh: bool = False) -> tuple[socket.socket, bool]:
        """A pooled connection (``reused`` True) or a new one."""
        if peer.idle and not fresh:
            return peer.idle.pop(), True
        loop = asyncio.get_running_loop()
        where = f"peer {peer.name} at {peer.host}:{peer.port}"
        try:
            infos = await loop.getaddrinfo(peer.host, peer.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise KVTransportError(f"cannot resolve {where}: {exc}") from None
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        tune(sock)
        try:
            await loop.sock_connect(sock, addr)
        except OSError as exc:
            sock.close()
            raise KVTransportError(f"cannot connect to {where}: {exc.strerror or exc}") from None
        return sock, False

    def _release(self, peer: _Peer, sock: socket.socket) -> None:
        if len(peer.idle) < _MAX_IDLE:
            peer.idle.append(sock)
        else:
            sock.close()

    async def _request(self, peer: _Peer, work: Callable[[socket.socket], Awaitable[_T]]) -> _T:
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
                raise KVTransportError(f"transfer with peer {peer.name} failed: {exc}") from None
            except TimeoutError:
                sock.close()
                raise KVTransportError(
                    f"peer {peer.name} did not complete within {self.io_timeout} s"
                ) from None
            except _Refused as exc:
                self._release(peer, sock)  # refused before streaming: the stream is clean
                raise KVTransportError(f"peer {peer.name} refused: {exc}") from None
            except (OSError, KVTransportError) as exc:
                sock.close()
                raise KVTransportError(f"transfer with peer {peer.name} failed: {exc}") from None
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
        except (ConnectionError, KVTransportError) as exc:
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
            raise KVTransportError(
                f"read pairs {len(local_blocks)} local with {len(remote_blocks)} remote blocks"
            )
        local = check_ids(list(local_blocks), self.pool.num_blocks, "local")
        remote = [int(b) for b in remote_blocks]
        nbytes = len(local) * self.pool.block_nbytes
        loop = asyncio.get_running_loop()
        times: dict[str, float] = {}

        req = {
            wire.OP: wire.OP_READ,
            wire.SENDER: self.name,
            wire.BLOCKS: remote,
            wire.NOTIFICATION: bytes(notification),
        }

        async def work(sock: socket.socket) -> None:
            t0 = time.perf_counter()
            head = await self._first_answer(loop, sock, req)
            times["post"] = time.perf_counter() - t0
            refused = wire.refusal(head)
            if refused is not None:
                raise _Refused(refused)
            if head.get(wire.NBYTES) != nbytes:
                raise KVTransportError(
                    f"owner announced {head.get(wire.NBYTES)} bytes, expected {nbytes}"
                )
            for start, count in block_runs(local):
                await sock_recv_into(loop, sock, pool_rows(self.pool, start, count))
            await sock_write_frame(loop, sock, {wire.OP: wire.OP_DONE})
            ack = await sock_read_frame(loop, sock)
            if ack is None or wire.refusal(ack) is not None:
                raise KVTransportError(f"owner did not acknowledge completion: {ack!r}")
            times["xfer"] = time.perf_counter() - t0

        await self._request(p, work)
        return ReadResult(
            bytes=nbytes, descriptors=len(local), post_time=times["post"], xfer_time=times["xfer"]
        )

    def peer_has_fence(self, peer: str) -> bool:
        p = self._peers.get(peer)
        return p is not None and p.fence_slots > 0

    async def read_word(self, peer: str, slot: int) -> int:
        p = self._peer(peer)
        if not 0 <= slot < p.fence_slots:
            raise KVTransportError(f"peer {peer} has no fence word {slot}")
        loop = asyncio.get_running_loop()
        req = {wire.OP: wire.OP_WORD, wire.SLOT: int(slot)}

        async def work(sock: socket.socket) -> int:
            answer = await self._first_answer(loop, sock, req)
            refused = wire.refusal(answer)
            if refused is not None:
                raise _Refused(refused)
            word = answer.get(wire.WORD)
            if not isinstance(word, int) or isinstance(word, bool):
                raise KVTransportError(f"owner answered a fence word of {word!r}")
            return word

        return await self._request(p, work)

    async def notify(self, peer: str, message: bytes) -> None:
        p = self._peer(peer)
        loop = asyncio.get_running_loop()

        req = {wire.OP: wire.OP_NOTIF, wire.SENDER: self.name, wire.MESSAGE: bytes(message)}

        async def work(sock: socket.socket) -> None:
            ack = await self._first_answer(loop, sock, req)
            refused = wire.refusal(ack)
            if refused is not None:
                raise _Refused(refused)

        await self._request(p, work)


class _Refused(KVTransferError):
    """The owner answered with an error before any bulk bytes (connection still clean)."""


class _Stale(KVTransferError):
    """The connection died before the owner answered: the request had no effect."""
