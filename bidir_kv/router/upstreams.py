"""The engines a router forwards to (its upstreams): health, load, and sticky choice.

The upstream proxy round-robins D per request, so a turn usually lands on a D
without the conversation's prefix and the whole history crosses the network a
second time. Here the next turn goes to the D (and P) that served the last one
while it is healthy; otherwise to the least-loaded healthy node
(:func:`bidir_kv.policy.node_load`: requests reserved on it from the moment they
were picked, plus the turns this router holds in its store for it, weighted).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import aiohttp

from bidir_kv.policy import least_loaded, node_load, stale_cutoff
from bidir_kv.wire.ids import RequestId

__all__ = ["HealthChecker", "Role", "Upstream", "UpstreamPool"]

log = logging.getLogger("bidir_kv.router")
Role = Literal["prefill", "decode"]


@dataclass(eq=False)
class Upstream:
    """One engine; ``host`` is what the router rewrites ``remote_host`` to."""

    role: Role
    host: str
    port: int
    healthy: bool = True
    inflight: int = 0  # requests open to it right now
    reserved: int = 0  # turns placed on it whose leg has not ended (picked, maybe not sent)
    held: dict[str, float] = field(default_factory=dict)  # stored turns: request id -> time
    last_error: str | None = None
    strikes: int = 0  # consecutive failed health probes
    last_change: float = field(default_factory=time.monotonic)
    engine_id: str | None = None  # as its last params named it (router/peers.py)
    drop_peer: bool | None = None  # False: answered 404 to POST /drop_peer, never asked again

    @property
    def id(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def mark(self, healthy: bool, error: str | None = None) -> None:
        if healthy != self.healthy:
            self.last_change = time.monotonic()
            if healthy:
                log.info("%s node %s is healthy again", self.role, self.id)
            else:
                log.warning("%s node %s marked down: %s", self.role, self.id, error)
        self.healthy = healthy
        self.last_error = None if healthy else error


class UpstreamPool:
    """The upstream engines of one role."""

    def __init__(
        self,
        role: Role,
        hosts: Sequence[str],
        ports: Sequence[int],
        held_weight: float = 0.0,
        held_ttl: float = float("inf"),
    ) -> None:
        if len(hosts) != len(ports):
            raise ValueError(
                f"{role}: {len(hosts)} host(s) but {len(ports)} port(s); give one port per host"
            )
        if not hosts:
            raise ValueError(f"{role}: at least one node is required")
        self.role: Role = role
        self.nodes = [
            Upstream(role, host, int(port)) for host, port in zip(hosts, ports, strict=True)
        ]
        self._by_id = {node.id: node for node in self.nodes}
        self._rr = itertools.count()
        self.held_weight = held_weight
        self.held_ttl = held_ttl  # a held turn older than this is no longer counted

    def get(self, upstream_id: str | None) -> Upstream | None:
        return None if upstream_id is None else self._by_id.get(upstream_id)

    def healthy(self) -> list[Upstream]:
        return [node for node in self.nodes if node.healthy]

    def pick(
        self, preferred: str | None = None, exclude: Upstream | None = None
    ) -> Upstream | None:
        """The preferred node if healthy, else the least-loaded healthy one (ties rotate)."""
        pref = self.get(preferred)
        if pref is not None and pref.healthy and pref is not exclude:
            return pref
        candidates = [node for node in self.nodes if node.healthy and node is not exclude]
        if not candidates:
            return None
        now = time.monotonic()
        loads = [self.load(node, now) for node in candidates]
        tied = least_loaded(loads)
        return candidates[tied[next(self._rr) % len(tied)]]

    def load(self, node: Upstream, now: float | None = None) -> float:
        """What placement compares (:func:`bidir_kv.policy.node_load`)."""
        return node_load(
            max(node.reserved, node.inflight), self.held_count(node, now), self.held_weight
        )

    # ---- held work: turns in the store whose KV the node keeps pinned ------------

    def hold(self, node_id: str, request_id: RequestId) -> None:
        node = self.get(node_id)
        if node is not None:
            node.held.pop(request_id, None)  # keep the dict in time order
            node.held[request_id] = time.monotonic()

    def unhold(self, node_id: str | None, request_id: RequestId) -> None:
        node = self.get(node_id)
        if node is not None:
            node.held.pop(request_id, None)

    def held_count(self, node: Upstream, now: float | None = None) -> int:
        """Held turns, forgetting those older than ``held_ttl`` (taken by another
        replica, or expired in a shared store)."""
        cutoff = stale_cutoff(time.monotonic() if now is None else now, self.held_ttl)
        while node.held:
            rid, at = next(iter(node.held.items()))
            if at >= cutoff:
                break
            del node.held[rid]
        return len(node.held)

    def down_description(self) -> str:
        parts = [
            f"{node.id} ({node.last_error or 'unhealthy'})"
            for node in self.nodes
            if not node.healthy
        ]
        return ", ".join(parts) or "none"


class HealthChecker:
    """Polls every node's ``/health`` in the background and flips ``healthy``."""

    SLOW_STRIKES = 2

    def __init__(
        self,
        pools: Sequence[UpstreamPool],
        session: aiohttp.ClientSession,
        interval: float,
        timeout: float = 5.0,
    ) -> None:
        self.pools = pools
        self.session = session
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._task: asyncio.Task[None] | None = None
        self.rounds = 0
        self.on_down: Callable[[Upstream], None] | None = None  # a probe marked it down

    async def check(self, node: Upstream) -> None:
        """One probe (:meth:`probe`); :attr:`on_down` hears of a node it marked down."""
        was = node.healthy
        await self.probe(node)
        if was and not node.healthy and self.on_down is not None:
            self.on_down(node)

    async def probe(self, node: Upstream) -> None:
        """One probe. A refused connection marks the node down at once; a slow or
        failing answer only after ``SLOW_STRIKES`` probes in a row (a busy engine is
        not a dead one)."""
        try:
            async with self.session.get(f"{node.url}/health", timeout=self.timeout) as resp:
                await resp.read()
                if resp.status == 200:
                    node.strikes = 0
                    node.mark(True)
                    return
                problem = f"/health returned {resp.status}"
        except aiohttp.ClientConnectorError as exc:
            node.strikes = self.SLOW_STRIKES
            node.mark(False, f"/health failed: {exc.__class__.__name__}: {exc}")
            return
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            problem = f"/health failed: {exc.__class__.__name__}: {exc}"
        node.strikes += 1
        if node.strikes >= self.SLOW_STRIKES:
            node.mark(False, problem)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(node) for pool in self.pools for node in pool.nodes))
        self.rounds += 1

    async def _loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        if self.interval > 0 and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="health-checks")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
