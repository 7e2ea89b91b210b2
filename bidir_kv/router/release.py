"""Free D's retained blocks at once for a turn the router will not store.

D keeps a finished turn's KV pinned for ``decoder_kv_blocks_ttl`` (480 s by
default) waiting for the next turn's P to read it. A turn the router does not
store (no conversation id, reasoning/tool deltas it cannot verify, a store
entry evicted or replaced, a client that left after D finished) will never be
read, so those blocks only cost D memory. A *release* is the cheapest request
that makes P notify D without reading: a one-token ``/v1/completions`` call
(``max_tokens: 1``) with D's dict and ``remote_num_tokens: 0``. P's pull count is
then ``<= 0``, so it takes the notify-only path (docs/protocol.md §4.3) and D
frees the blocks on the notification.

Releases run in the background, at most ``release_concurrency`` at once and
``max_pending_releases`` queued (beyond that one is dropped and counted); the
client's answer never waits on one. The cost on P: one prefill of one token,
whose single block P holds under its ``kv_lease_duration`` (nobody reads it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import uuid
from typing import Any

import aiohttp

from bidir_kv.protocol import KVTransferParams
from bidir_kv.router.failures import JSON
from bidir_kv.router.guard import release_params
from bidir_kv.router.metrics import RouterMetrics
from bidir_kv.router.settings import RouterSettings
from bidir_kv.router.store import Entry
from bidir_kv.router.upstreams import UpstreamPool

__all__ = ["RELEASE_PROMPT", "Releaser"]

log = logging.getLogger("bidir_kv.router")

# Any prompt works (remote_num_tokens 0 makes P's pull count <= 0); the shortest costs least.
RELEASE_PROMPT = "."


class Releaser:
    """Background, bounded notify-only releases of D's blocks through P."""

    def __init__(
        self,
        prefill: UpstreamPool,
        decode: UpstreamPool,
        session: aiohttp.ClientSession,
        settings: RouterSettings,
        metrics: RouterMetrics,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.session = session
        self.settings = settings
        self.metrics = metrics
        self._slots = asyncio.Semaphore(settings.release_concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        api_key = os.environ.get("OPENAI_API_KEY")
        self._api_auth = f"Bearer {api_key}" if api_key else None

    @property
    def pending(self) -> int:
        return len(self._tasks)

    def release_entry(self, entry: Entry, reason: str) -> bool:
        """Release a store entry that will never be taken (evicted, replaced, stale)."""
        return self.release(
            entry.params, entry.decode, reason, model=entry.model, prefill=entry.prefill
        )

    def release(
        self,
        params: KVTransferParams | None,
        decode_id: str | None,
        reason: str,
        *,
        model: Any = None,
        prefill: str | None = None,
        auth: str | None = None,
    ) -> bool:
        """Queue a release of the blocks D returned in ``params``; False if not queued."""
        if params is None or not params.has_remote_blocks:
            return False
        m = self.metrics
        holder = self.decode.get(decode_id)
        if holder is not None and not holder.healthy:
            m.release_failures.labels("holder_down").inc()
            return False
        if len(self._tasks) >= self.settings.max_pending_releases:
            m.release_failures.labels("overflow").inc()
            log.warning(
                "release of D's blocks (remote_request_id=%s) dropped: %d pending",
                params.remote_request_id,
                len(self._tasks),
            )
            return False
        host = holder.host if holder is not None else params.remote_host
        kv = release_params(params.for_prefill_hit(host))
        task = asyncio.create_task(self._send(kv, reason, model, prefill, auth))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _send(
        self,
        kv: KVTransferParams,
        reason: str,
        model: Any,
        prefill: str | None,
        auth: str | None,
    ) -> None:
        async with self._slots:
            node = self.prefill.pick(prefill)
            if node is None:
                self.metrics.release_failures.labels("no_prefill").inc()
                return
            body: dict[str, Any] = {
                "prompt": RELEASE_PROMPT,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": kv.to_dict(),
            }
            if isinstance(model, str):
                body["model"] = model
            headers = {"Content-Type": JSON, "X-Request-Id": f"release-{uuid.uuid4()}"}
            if self._api_auth or auth:
                headers["Authorization"] = self._api_auth or auth or ""
            timeout = aiohttp.ClientTimeout(total=self.settings.prefill_timeout)
            try:
                async with self.session.post(
                    f"{node.url}/v1/completions",
                    data=json.dumps(body),
                    headers=headers,
                    timeout=timeout,
                ) as resp:
                    raw = await resp.read()
                    ok = resp.status // 100 == 2
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                self.metrics.release_failures.labels("unreachable").inc()
                log.warning(
                    "release of D's blocks (remote_request_id=%s) via P %s failed: %s",
                    kv.remote_request_id,
                    node.id,
                    exc,
                )
                return
            if not ok:
                self.metrics.release_failures.labels("http").inc()
                log.warning(
                    "release of D's blocks (remote_request_id=%s): P %s answered HTTP %d: %s",
                    kv.remote_request_id,
                    node.id,
                    resp.status,
                    raw[:200].decode("utf-8", "replace"),
                )
                return
            self.metrics.releases.labels(reason).inc()
            log.info(
                "released D's blocks (remote_request_id=%s, reason=%s) via P %s",
                kv.remote_request_id,
                reason,
                node.id,
            )

    async def drain(self) -> None:
        """Wait for queued releases (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Cancel what is still queued (shutdown: D's TTL frees those blocks)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
