"""The owner's end of the TCP transport: the data port that peers read our pool from.

A reader's ``read`` names block ids and a notification; the owner checks the ids,
announces the byte count, streams the rows raw, and once the reader says it has them
all (``done``) hands the notification to the engine. Messages: :mod:`.wire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

import numpy as np

from bidir_kv.engine.transport import wire
from bidir_kv.engine.transport.base import KVPool, KVTransportError
from bidir_kv.engine.transport.dispatch import NotificationDispatcher
from bidir_kv.engine.transport.framing import sock_read_frame, sock_write_frame
from bidir_kv.engine.transport.tcp_io import block_runs, check_ids, pool_rows, tune

__all__ = ["TcpOwner"]

logger = logging.getLogger("bidir_kv.engine.transport")

_BACKLOG = 64


class TcpOwner:
    """Serves our ``pool`` on a data port; received notifications go to ``dispatch``."""

    def __init__(
        self, pool: KVPool, dispatch: NotificationDispatcher, fence: np.ndarray | None = None
    ) -> None:
        self.pool = pool
        self.fence = fence  # D's fence words, read one at a time by OP_WORD
        self._dispatch = dispatch
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def listen(self, host: str, port: int) -> int:
        """Bind ``host:port`` (0: any free port), start accepting; the bound port."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        if not infos:
            raise KVTransportError(f"cannot resolve data host {host!r}")
        family, _, _, _, addr = infos[0]
        lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind(addr)
            lsock.listen(_BACKLOG)
        except OSError as exc:
            lsock.close()
            raise KVTransportError(
                f"TCP transport cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None
        lsock.setblocking(False)
        self._listener = lsock
        self._spawn(self._accept_loop(lsock))
        return int(lsock.getsockname()[1])

    async def close(self) -> None:
        """Stop listening and drop every connection being served."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(lsock)
            except OSError:
                return
            tune(conn)
            self._spawn(self._serve(conn))

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                req = await sock_read_frame(loop, sock)
                if req is None:
                    return
                op = req.get(wire.OP)
                if op == wire.OP_READ:
                    await self._serve_read(loop, sock, req)
                elif op == wire.OP_WORD:
                    await sock_write_frame(loop, sock, self._word(req.get(wire.SLOT)))
                elif op == wire.OP_NOTIF:
                    self._deliver(req.get(wire.SENDER), req.get(wire.MESSAGE))
                    await sock_write_frame(loop, sock, wire.accept())
                else:
                    await sock_write_frame(loop, sock, wire.refuse(f"unknown op {op!r}"))
        except (OSError, KVTransportError) as exc:
            logger.debug("TCP transport: connection dropped: %s", exc)
        finally:
            sock.close()

    def _word(self, slot: Any) -> dict[str, Any]:
        fence = self.fence
        if fence is None:
            return wire.refuse("this owner has no fence words")
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < fence.shape[0]:
            return wire.refuse(f"fence slot {slot!r} out of range")
        return wire.accept({wire.WORD: int(fence[slot])})

    def _deliver(self, peer: Any, message: Any) -> None:
        if not isinstance(peer, str) or not isinstance(message, bytes):
            raise KVTransportError(f"malformed notification from {peer!r}: {message!r}")
        if message:
            self._dispatch.put(peer, message)

    async def _serve_read(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, req: dict[str, Any]
    ) -> None:
        try:
            blocks = check_ids(req.get(wire.BLOCKS), self.pool.num_blocks, "requested")
        except KVTransportError as exc:
            await sock_write_frame(loop, sock, wire.refuse(str(exc)))
            return
        nbytes = len(blocks) * self.pool.block_nbytes
        await sock_write_frame(loop, sock, wire.accept({wire.NBYTES: nbytes}))
        for start, count in block_runs(blocks):
            await loop.sock_sendall(sock, pool_rows(self.pool, start, count))
        done = await sock_read_frame(loop, sock)
        if done is None or done.get(wire.OP) != wire.OP_DONE:
            raise KVTransportError(f"reader did not confirm the read: {done!r}")
        self._deliver(req.get(wire.SENDER), req.get(wire.NOTIFICATION))
        await sock_write_frame(loop, sock, wire.accept())
