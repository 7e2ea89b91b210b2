"""Keep a conversation alive, close it, and let idle ones go: the renewable lease.

A stored turn with a lease (D advertised ``bidir_kv_lease`` in its dict, or the router
runs with ``--conversation-lease``) is held only while its conversation is active: each
turn stores a fresh entry, ``POST /v1/conversations/{id}/keepalive`` renews it, and
once ``idle`` seconds pass without either the sweeper drops the entry, which frees D's
blocks at once through the notify-only release (:mod:`bidir_kv.router.release`).
``DELETE /v1/conversations/{id}`` does the same now. D's ``decoder_kv_blocks_ttl``
stays the hard cap (the router's ``--cache-ttl`` below it). Nothing is lost: the next
turn of a closed or expired conversation is a miss, computed in full by P.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from bidir_kv.router.failures import error_response, error_response_for
from bidir_kv.router.identity import IdentityError, log_safe, path_conversation_key
from bidir_kv.router.metrics import RouterMetrics
from bidir_kv.router.store import ConversationStore, StoreError

__all__ = ["ConversationRoutes", "LeaseSweeper"]

log = logging.getLogger("bidir_kv.router")


class ConversationRoutes:
    """``DELETE /v1/conversations/{id}`` and ``POST /v1/conversations/{id}/keepalive``."""

    def __init__(self, store: ConversationStore, metrics: RouterMetrics) -> None:
        self.store = store
        self.metrics = metrics

    def add_to(self, app: web.Application) -> None:
        app.router.add_delete("/v1/conversations/{conversation_id}", self.close)
        app.router.add_post("/v1/conversations/{conversation_id}/keepalive", self.keepalive)

    async def close(self, request: web.Request) -> web.Response:
        try:
            key = path_conversation_key(request.match_info["conversation_id"], request.headers)
            closed = await self.store.end(key.storage_key)
        except IdentityError as exc:
            self.metrics.errors.labels("bad_request").inc()
            return error_response_for(exc)
        except StoreError as exc:
            return self._store_failed(exc)
        if not closed:
            self.metrics.closes.labels("not_found").inc()
            return _not_found(key.conversation_id)
        self.metrics.closes.labels("closed").inc()
        log.info("conv=%s: closed; releasing D's blocks", log_safe(key.conversation_id))
        # OpenAI's Conversations API answers a delete with this object
        return web.json_response(
            {"id": key.conversation_id, "object": "conversation.deleted", "deleted": True}
        )

    async def keepalive(self, request: web.Request) -> web.Response:
        try:
            key = path_conversation_key(request.match_info["conversation_id"], request.headers)
            renewal = await self.store.renew(key.storage_key)
        except IdentityError as exc:
            self.metrics.errors.labels("bad_request").inc()
            return error_response_for(exc)
        except StoreError as exc:
            return self._store_failed(exc)
        if renewal is None:
            self.metrics.keepalives.labels("not_found").inc()
            return _not_found(key.conversation_id)
        if renewal.lease is None or renewal.deadline is None:
            self.metrics.keepalives.labels("no_lease").inc()
            return error_response(
                409,
                f"conversation {key.conversation_id!r} has no lease to renew: its D "
                "advertised no bidir_kv_lease and the router runs without "
                "--conversation-lease, so its KV is held for --cache-ttl",
                "ConflictError",
            )
        self.metrics.keepalives.labels("renewed").inc()
        return web.json_response(
            {
                "id": key.conversation_id,
                "object": "conversation.lease",
                "lease_seconds": renewal.lease,
                "expires_in": round(max(0.0, renewal.deadline - self.store.now()), 3),
            }
        )

    def _store_failed(self, exc: StoreError) -> web.Response:
        self.metrics.errors.labels("store").inc()
        log.error("%s", exc)
        return error_response_for(exc)


def _not_found(conversation_id: str) -> web.Response:
    return error_response(
        404,
        f"conversation {conversation_id!r} not found: no stored turn for it (never "
        "stored, closed or expired)",
        "NotFoundError",
    )


class LeaseSweeper:
    """Background task: every ``interval`` s, drop the entries whose lease went idle
    (the store reports each, so the flow releases D's blocks)."""

    def __init__(self, store: ConversationStore, metrics: RouterMetrics, interval: float):
        self.store = store
        self.metrics = metrics
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.interval > 0 and self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def sweep(self) -> int:
        """One pass; how many leases expired (0 when the store is unreachable)."""
        try:
            n = await self.store.expire_leases()
        except StoreError as exc:
            log.error("lease sweep: %s", exc)
            return 0
        if n:
            self.metrics.lease_expiries.inc(n)
            log.info("%d idle conversation lease(s) expired; releasing D's blocks", n)
        return n

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.sweep()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
