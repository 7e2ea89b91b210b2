"""The engines a router forwards to (its upstreams): health, load, sticky choice, and
what the router learns from each node instead of assuming it (its block size).

The upstream proxy round-robins D per request, so a turn usually lands on a D
without the conversation's prefix and the whole history crosses the network a
second time. Here the next turn goes to the D (and P) that served the last one
while it is healthy; otherwise to the least-loaded healthy node
(:func:`bidir_kv.policy.node_load`: requests reserved on it from the moment they
were picked, plus the turns this router holds in its store for it, weighted).

A node's block size is read from its ``/metrics`` (vLLM's ``vllm:cache_config_info``
labels) when it first answers a health probe, again after it was down or restarted
under another engine id, and on demand when a turn needs it before any probe
(:class:`NodeFacts`). A P and a D whose block sizes differ are never paired: P reads
D's blocks by index, so a trim or a pull between them would pair tokens wrongly.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import aiohttp

from bidir_kv.policy import least_loaded, node_load, stale_cutoff
from bidir_kv.scrape import reported_block_size
from bidir_kv.wire.ids import RequestId

__all__ = [
    "HealthChecker",
    "NodeFacts",
    "Role",
    "Upstream",
    "UpstreamPool",
    "pair_problem",
    "sizes_differ",
]

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
    # the size of the blocks its kv_transfer_params list: what the node reports, else
    # --block-size, else None (unknown); ``reported`` is the node's own figure
    block_size: int | None = None
    reported_block_size: int | None = None
    asked_block_size: bool = False  # /metrics read since it last came up
    ask_again_at: float | None = None  # a failed read: when to try again (monotonic)
    # a P whose last dict carried the verify advert (wire.params.advertises_verify): it
    # reads only the prefix D's token chain proves, so D's whole dict may go to it
    verifies: bool = False

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
                # it may come back as another engine: ask its block size again, and
                # trust no verify advert until its next dict carries one
                self.asked_block_size = False
                self.verifies = False
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
        self,
        preferred: str | None = None,
        exclude: Upstream | None = None,
        pair: Upstream | None = None,
    ) -> Upstream | None:
        """The preferred node if healthy, else the least-loaded healthy one (ties rotate);
        with ``pair``, only nodes whose block size does not differ from its."""

        def usable(node: Upstream) -> bool:
            return node.healthy and node is not exclude and not sizes_differ(node, pair)

        pref = self.get(preferred)
        if pref is not None and usable(pref):
            return pref
        candidates = [node for node in self.nodes if usable(node)]
        if not candidates:
            return None
        now = time.monotonic()
        loads = [self.load(node, now) for node in candidates]
        tied = least_loaded(loads)
        return candidates[tied[next(self._rr) % len(tied)]]

    def fits(self, node: Upstream) -> bool:
        """Some healthy node here can exchange KV with ``node`` (same block size)."""
        return any(not sizes_differ(mine, node) for mine in self.healthy())

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


def sizes_differ(a: Upstream | None, b: Upstream | None) -> bool:
    """Both block sizes known and unequal: the two nodes cannot exchange KV."""
    if a is None or b is None or a.block_size is None or b.block_size is None:
        return False
    return a.block_size != b.block_size


def pair_problem(prefill: UpstreamPool, decode: UpstreamPool) -> str:
    """Why no healthy P fits any healthy D: every pair's block sizes, by node."""
    pairs = [
        f"prefill {p.id} has block size {p.block_size}, decode {d.id} has {d.block_size}"
        for d in decode.healthy()
        for p in prefill.healthy()
        if sizes_differ(p, d)
    ]
    return (
        "no healthy P/D pair with the same block size ("
        + "; ".join(pairs)
        + "): P reads D's blocks by index, so both must run with the same --block-size"
    )


class NodeFacts:
    """What the router learns from a node rather than assumes: its block size.

    Read from ``vllm:cache_config_info`` on the node's ``/metrics`` once per start
    (:meth:`learn`, single flight per node); :meth:`forget` when the node went down or
    restarted. Precedence: the node's own figure, then ``override`` (``--block-size``,
    for nodes that export none), else unknown. A node that reports another size than
    ``--block-size`` is logged once at ERROR and its own figure is used: trimming with
    a wrong size would hand P blocks of other tokens.
    """

    def __init__(
        self, session: aiohttp.ClientSession, override: int | None, timeout: float = 5.0
    ) -> None:
        self.session = session
        self.override = override
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._asking: dict[str, asyncio.Future[None]] = {}
        self._told: set[tuple[str, str]] = set()  # (node, finding) already logged

    def adopt(self, pools: Sequence[UpstreamPool]) -> None:
        """Start every node at the override (what is assumed until a node says)."""
        for pool in pools:
            for node in pool.nodes:
                node.block_size = node.reported_block_size or self.override

    RETRY_SECONDS: Final = 30.0  # a node whose /metrics could not be read is asked again

    def due(self, node: Upstream) -> bool:
        """The node must be asked: not since it came up, or a failed read is old enough."""
        if not node.asked_block_size:
            return True
        return node.ask_again_at is not None and time.monotonic() >= node.ask_again_at

    async def settle(self, *pools: UpstreamPool) -> None:
        """Ask every healthy node that is :meth:`due` (placement needs their sizes)."""
        due = [node for pool in pools for node in pool.nodes if node.healthy and self.due(node)]
        if due:
            await asyncio.gather(*(self.learn(node) for node in due))

    def forget(self, node: Upstream) -> None:
        """The node restarted (another engine id): ask again; the override holds until
        then. (A node marked down is asked again too: :meth:`Upstream.mark`.)"""
        node.asked_block_size = False
        node.reported_block_size = None
        node.block_size = self.override
        node.verifies = False

    async def block_size(self, node: Upstream) -> int | None:
        """The node's block size, asking it first if it was not asked since it came up."""
        if self.due(node):
            await self.learn(node)
        return node.block_size

    async def learn(self, node: Upstream) -> None:
        """Read the node's block size from its ``/metrics`` (one request at a time)."""
        pending = self._asking.get(node.id)
        if pending is None:
            pending = asyncio.ensure_future(self._ask(node))
            self._asking[node.id] = pending
            pending.add_done_callback(lambda _: self._asking.pop(node.id, None))
        await asyncio.shield(pending)

    async def _ask(self, node: Upstream) -> None:
        where = f"{node.role} node {node.id}"
        try:
            async with self.session.get(f"{node.url}/metrics", timeout=self.timeout) as resp:
                text = (await resp.read()).decode("utf-8", "replace")
                if resp.status != 200:
                    raise ValueError(f"/metrics returned {resp.status}")
            size = reported_block_size(text)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            node.asked_block_size = True
            node.ask_again_at = time.monotonic() + self.RETRY_SECONDS
            self._note(node, "unread", f"{where}: block size unreadable ({exc}); {self._meanwhile}")
            return
        node.asked_block_size = True
        node.ask_again_at = None
        node.reported_block_size = size
        node.block_size = self.override if size is None else size
        if size is None:
            self._note(node, "none", f"{where} exports no block size; {self._meanwhile}")
        elif self.override is not None and size != self.override:
            self._note(
                node,
                f"conflict {size}",
                f"{where} reports block size {size} but --block-size is {self.override}; "
                f"using the node's {size}",
                logging.ERROR,
            )
        else:
            log.info("%s: block size %d", where, size)

    @property
    def _meanwhile(self) -> str:
        if self.override is not None:
            return f"--block-size {self.override} applies to it"
        return "until it does, only exact continuations are reused (no trim)"

    def _note(self, node: Upstream, kind: str, message: str, level: int = logging.WARNING) -> None:
        """One line per node and kind of finding (a node that keeps failing is logged once)."""
        if (node.id, kind) not in self._told:
            self._told.add((node.id, kind))
            log.log(level, "%s", message)


class HealthChecker:
    """Polls every node's ``/health`` in the background and flips ``healthy``; learns a
    node's block size (:class:`NodeFacts`) when it first answers, again after it was
    down."""

    SLOW_STRIKES = 2

    def __init__(
        self,
        pools: Sequence[UpstreamPool],
        session: aiohttp.ClientSession,
        interval: float,
        timeout: float = 5.0,
        facts: NodeFacts | None = None,
    ) -> None:
        self.pools = pools
        self.session = session
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.facts = facts
        self._task: asyncio.Task[None] | None = None
        self.rounds = 0
        self.on_down: Callable[[Upstream], None] | None = None  # a probe marked it down

    async def check(self, node: Upstream) -> None:
        """One probe (:meth:`probe`); :attr:`on_down` hears of a node it marked down."""
        was = node.healthy
        await self.probe(node)
        if was and not node.healthy and self.on_down is not None:
            self.on_down(node)
        if node.healthy and self.facts is not None and self.facts.due(node):
            await self.facts.learn(node)

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
