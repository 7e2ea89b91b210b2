"""Telling engines that a paired engine is gone: ``POST /drop_peer {"engine_id": ...}``.

vLLM's direction for dead peers is router-driven (PR #56341): the router, which sees
every node's health, tells the nodes paired with a dead one to abort what is routed
to it, free the blocks pinned for it and drop its transport state, instead of each
engine waiting out its own timeouts. A node "dies" when the health probe marks it
down, and "restarts" when its params name another engine id than before; either way
every node of the other role gets the old engine id, once. An engine without the
endpoint answers 404: that is remembered per node and never asked again.
docs/router.md "Dead peers".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp

from bidir_kv.router.metrics import RouterMetrics
from bidir_kv.router.upstreams import Upstream, UpstreamPool

__all__ = ["PeerDropper"]

log = logging.getLogger("bidir_kv.router")


class PeerDropper:
    """Learns each node's engine id from its params; announces the ids that are gone."""

    def __init__(
        self,
        pools: Sequence[UpstreamPool],
        session: aiohttp.ClientSession,
        metrics: RouterMetrics,
        timeout: float = 5.0,
    ) -> None:
        self.pools = pools
        self.session = session
        self.metrics = metrics
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._announced: set[str] = set()  # engine ids already announced gone
        self._tasks: set[asyncio.Task[None]] = set()

    def seen(self, node: Upstream, engine_id: object) -> bool:
        """``node`` answered with params naming ``engine_id``; another id than last
        time means it restarted: its old id is announced gone, and True is returned."""
        if not isinstance(engine_id, str) or not engine_id:
            return False
        old, node.engine_id = node.engine_id, engine_id
        if old is not None and old != engine_id:
            self.announce(node, old, "restarted")
            return True
        return False

    def down(self, node: Upstream) -> None:
        """The health probe marked ``node`` down: announce its last engine id gone."""
        if node.engine_id is not None:
            self.announce(node, node.engine_id, "down")

    def announce(self, node: Upstream, engine_id: str, why: str) -> None:
        """Ask every node of the other role, once per engine id, to drop ``engine_id``."""
        if engine_id in self._announced:
            return
        self._announced.add(engine_id)
        peers = [
            peer
            for pool in self.pools
            if pool.role != node.role
            for peer in pool.nodes
            if peer.drop_peer is not False
        ]
        log.warning(
            "%s node %s (engine %s) %s; asking %d peer(s) to drop it",
            node.role,
            node.id,
            engine_id,
            why,
            len(peers),
        )
        for peer in peers:
            task = asyncio.get_running_loop().create_task(self._drop(peer, engine_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _drop(self, peer: Upstream, engine_id: str) -> None:
        try:
            async with self.session.post(
                f"{peer.url}/drop_peer", json={"engine_id": engine_id}, timeout=self.timeout
            ) as resp:
                await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self.metrics.drop_peer.labels("failed").inc()
            log.warning("drop_peer %s on %s failed: %s", engine_id, peer.id, exc)
            return
        if status == 404:  # the engine has no such endpoint (vLLM without PR #56341)
            peer.drop_peer = False
            self.metrics.drop_peer.labels("unsupported").inc()
            log.info("%s has no /drop_peer (HTTP 404); not asking it again", peer.id)
        elif status // 100 == 2:
            self.metrics.drop_peer.labels("sent").inc()
        else:
            self.metrics.drop_peer.labels("failed").inc()
            log.warning("drop_peer %s on %s: HTTP %d", engine_id, peer.id, status)

    async def settle(self) -> None:
        """Wait for the calls under way (shutdown, tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
