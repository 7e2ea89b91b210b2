"""In-order delivery of received notifications to the engine's handler, on its loop.

Both transports receive notifications somewhere other than the engine's code path
(a socket task, a NIXL poll); this queue hands each one to the handler exactly once,
in arrival order, and keeps a failing handler from killing the transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging

from bidir_kv.engine.transport.base import NotificationHandler

__all__ = ["NotificationDispatcher"]

logger = logging.getLogger("bidir_kv.engine.transport")


class NotificationDispatcher:
    def __init__(self, handler: NotificationHandler) -> None:
        self._handler = handler
        self._queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def put(self, peer: str, message: bytes) -> None:
        self._queue.put_nowait((peer, message))

    async def _run(self) -> None:
        while True:
            peer, message = await self._queue.get()
            try:
                result = self._handler(peer, message)
                if inspect.isawaitable(result):
                    await result
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("notification handler failed for %r from %s", message, peer)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
