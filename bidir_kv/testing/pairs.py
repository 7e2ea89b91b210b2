"""The conformance tier's vLLM servers beside a backend's main pair, shared per configuration.

Starting a vLLM server on CPU costs 30-60 s (docs/vllm-cpu.md §5.2), so a scenario that
needs a P or a pair configured differently from the backend's main pair gets the one
of that configuration that already runs: :class:`PairPool` starts each configuration
once per backend and session (a :class:`PairConfig`, or a P variant's
``kv_connector_extra_config``) and keeps it for every later scenario asking for the same
(docs/conformance.md, "Pairs and what they cost").

One core per server: on vllm-cpu the pool keeps exactly one P and one D running. Using a
server's client (any request, any ``/metrics`` scrape) makes its configuration the
running one: the servers of the others are stopped (SIGSTOP, checked by
:func:`bidir_kv.testing.faults.pause_process`) and continue when their turn comes. A
stopped server uses no CPU and keeps its state, sockets and NIXL registrations; what
it holds (retained turns) waits with it. At most ``budget`` servers live beside the main
pair (memory: about 2.7 GB each); the least recently used configuration is stopped for
good to make room.

A scenario that needs a pair no other scenario may see (a fault it injects, a state it
cannot undo) asks for a fresh one (:meth:`PairPool.fresh`), stopped when it ends, and
says why. Every shared pair is left as its users found it: a scenario releases the turns
D retains for it (:meth:`SharedPair.drain` releases what earlier users kept).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from bidir_kv.protocol import KVTransferParams
from bidir_kv.testing.faults import restart_node
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.testing.poll import wait_for
from bidir_kv.topology.base import Node, Topology

__all__ = [
    "KV_USAGE",
    "SMALL_D_BLOCKS",
    "SMALL_MAX_MODEL_LEN",
    "SMALL_PAIR_TIMING",
    "PairConfig",
    "PairPool",
    "PrefillConfig",
    "SharedPair",
    "Timing",
    "kv_items",
    "small_pair",
]

KV_USAGE = "vllm:kv_cache_usage_perc"
_PROBE_TOKEN = 7  # an ordinary token on both models


def kv_items(kv: dict[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """``kv`` as a sorted tuple (a hashable part of a configuration's key)."""
    return tuple(sorted((kv or {}).items()))


@dataclass(frozen=True)
class PairConfig:
    """A P and a D of their own: D with ``decode_blocks`` KV blocks (one is the null
    block, as on vLLM) and ``max_model_len``; ``prefill_kv``/``decode_kv`` are
    ``kv_connector_extra_config`` keys plus the top-level ``kv_load_failure_policy``;
    ``emulator_args`` go to the emulator's engines only (its vLLM-reproducing modes)."""

    decode_blocks: int
    max_model_len: int
    prefill_kv: tuple[tuple[str, Any], ...] = ()
    decode_kv: tuple[tuple[str, Any], ...] = ()
    emulator_args: tuple[str, ...] = ()
    decode_prefix_caching: bool = True


@dataclass(frozen=True)
class PrefillConfig:
    """An extra P beside the main D: its ``kv_connector_extra_config`` keys (plus the
    top-level ``kv_load_failure_policy``), whether its prefix cache is on, and more
    ``vllm serve`` / engine arguments."""

    kv: tuple[tuple[str, Any], ...] = ()
    prefix_caching: bool = True
    extra_args: tuple[str, ...] = ()


@dataclass
class SharedPair:
    """A pair of the pool (or a fresh one): its topology, its clients, and the D dicts
    its users left retained on D (``held``: released by the next :meth:`drain`)."""

    topology: Topology
    prefill: EngineClient
    decode: EngineClient
    config: PairConfig
    held: list[KVTransferParams] = field(default_factory=list)

    def use(self) -> None:
        """Make this pair the running one. Its clients do so on every request; traffic
        that does not go through them (a router in front of the pair) needs this first."""
        if self.prefill.before_use is not None:
            self.prefill.before_use()

    def restart(self, role: str) -> None:
        """Restart P or D as a deploy would (same engine id and ports, new process);
        checked: the old process is gone and a new one serves (``restart_node``)."""
        node = (self.topology.prefill if role == "prefill" else self.topology.decode)[0]
        restart_node(self.topology, node)

    def blocks_in_use(self) -> int:
        """D's KV blocks in use, retained turns included. A one-token request first makes
        D step, so the usage gauge is fresh (engines set it at the end of a step, not
        when a notification or the TTL frees blocks); its own block is freed by then or
        counted as one."""
        self.decode.complete([_PROBE_TOKEN], 1, timeout=30)
        usage = self.decode.metrics([KV_USAGE]).value(KV_USAGE)
        return round(usage * (self.config.decode_blocks - 1))

    def release(self, params: KVTransferParams) -> None:
        """Free D's blocks of a turn nobody continues, as our router does: a one-token
        request through P with D's dict and ``remote_num_tokens: 0`` (notify-only)."""
        self.prefill.complete(
            [_PROBE_TOKEN],
            1,
            params.with_fields(remote_num_tokens=0).for_prefill_hit(),
            timeout=30,
        )

    def drain(self, timeout: float) -> None:
        """Release the turns earlier users left (``held``) and wait until D holds no
        retained KV."""
        held, self.held = self.held, []
        for params in held:
            self.release(params)
        wait_for(lambda: self.blocks_in_use() <= 1, timeout, "D's KV cache to drain", interval=0.5)


# what starts a pair, a P variant; what pauses a node of a topology
PairStarter = Callable[[str, PairConfig], Topology]
PrefillStarter = Callable[[str, PrefillConfig], Topology]
Pauser = Callable[[Topology, Node], AbstractContextManager[object]]


@dataclass
class _Group:
    """Servers that run together: the main pair, a shared pair, or a P variant (which
    runs with the main D)."""

    key: Any
    topology: Topology | None  # None: the main pair (the backend closes it)
    clients: list[EngineClient]
    with_main_decode: bool = False
    shared: SharedPair | None = None
    last_used: float = field(default_factory=time.monotonic)
    paused: dict[str, contextlib.ExitStack] = field(default_factory=dict)  # by node name


class PairPool:
    """A backend's extra servers, one set per configuration, and which of them run."""

    def __init__(
        self,
        backend: str,
        main: Topology,
        main_prefill: EngineClient,
        main_decode: EngineClient,
        *,
        start_pair: PairStarter | None,
        start_prefill: PrefillStarter | None,
        pause: Pauser | None,
        budget: int,
    ) -> None:
        self.backend = backend
        self._start_pair, self._start_prefill, self._pause = start_pair, start_prefill, pause
        self.budget = budget
        self._main = _Group("main", None, [main_prefill, main_decode])
        self._main_topology = main
        self._groups: dict[Any, _Group] = {}
        self._active: _Group | None = self._main  # None: every server paused
        self._serial = itertools.count()
        self.started: list[Any] = []  # every configuration started, in order (a record)
        for client in self._main.clients:
            client.before_use = self._use_main_client(client)

    # ---- what scenarios ask for ---------------------------------------------------

    def pair(self, config: PairConfig) -> SharedPair:
        """The pair of ``config``, running (started on first use)."""
        group = self._groups.get(("pair", config))
        if group is None:
            group = self._start(("pair", config), config)
        self._activate(group)
        assert group.shared is not None
        return group.shared

    def prefill(self, config: PrefillConfig, name: str) -> EngineClient:
        """The P variant of ``config`` (engine id ``prefill-<name>`` when it starts),
        running beside the main D."""
        group = self._groups.get(("prefill", config))
        if group is None:
            if self._start_prefill is None:
                raise _unavailable(f"the {self.backend} backend cannot start P variants")
            self._make_room(1)
            topo = self._start_prefill(name, config)
            group = self._adopt(("prefill", config), topo, [EngineClient(topo.prefill[0])])
            group.with_main_decode = True
        self._activate(group)
        return group.clients[0]

    @contextlib.contextmanager
    def fresh(self, config: PairConfig) -> Iterator[SharedPair]:
        """A pair of ``config`` nobody else uses, stopped when the block ends."""
        key = ("fresh", next(self._serial))
        group = self._start(key, config)
        self._activate(group)
        assert group.shared is not None
        try:
            yield group.shared
        finally:
            self._stop(group)

    def use_main(self) -> None:
        """Make the main pair the running one."""
        self._activate(self._main)

    def close(self) -> None:
        """Stop every server of the pool (the main pair is the backend's)."""
        for group in list(self._groups.values()):
            self._stop(group)
        self._resume(self._main)

    # ---- internals ----------------------------------------------------------------

    def _start(self, key: Any, config: PairConfig) -> _Group:
        if self._start_pair is None:
            raise _unavailable(f"the {self.backend} backend cannot start pairs")
        self._make_room(2)
        topo = self._start_pair(f"pair-{next(self._serial)}", config)
        p, d = EngineClient(topo.prefill[0]), EngineClient(topo.decode[0])
        group = self._adopt(key, topo, [p, d])
        group.shared = SharedPair(topo, p, d, config)
        return group

    def _adopt(self, key: Any, topo: Topology, clients: list[EngineClient]) -> _Group:
        group = _Group(key, topo, clients)
        self._groups[key] = group
        self.started.append(key)
        for client in clients:
            client.before_use = lambda g=group: self._activate(g)
        return group

    def _use_main_client(self, client: EngineClient) -> Callable[[], None]:
        is_decode = client is self._main.clients[1]

        def before_use() -> None:
            if is_decode and self._active is not None and self._active.with_main_decode:
                return  # a P variant runs with the main D
            self._activate(self._main)

        return before_use

    def _make_room(self, servers: int) -> None:
        """Pause everything (the new servers start alone) and stop the least recently
        used configurations until ``servers`` more fit the budget."""
        for group in [self._main, *self._groups.values()]:
            self._pause_group(group)
        self._active = None
        alive = sorted(self._groups.values(), key=lambda g: g.last_used)
        while alive and sum(len(g.clients) for g in alive) + servers > self.budget:
            self._stop(alive.pop(0))

    def _activate(self, group: _Group) -> None:
        group.last_used = time.monotonic()
        if self._active is group:
            return
        running = {id(group)} | ({id(self._main)} if group.with_main_decode else set())
        for other in [self._main, *self._groups.values()]:
            if id(other) not in running:
                self._pause_group(other, keep_decode=group.with_main_decode)
        self._resume(group)
        if group.with_main_decode:
            self._resume(self._main, only=self._main.clients[1])
        self._active = group

    def _pause_group(self, group: _Group, keep_decode: bool = False) -> None:
        if self._pause is None:
            return
        topo = group.topology or self._main_topology
        for client in group.clients:
            name = client.node.name
            if name in group.paused or (keep_decode and client is self._main.clients[1]):
                continue
            stack = contextlib.ExitStack()
            node = next(n for n in topo.nodes() if n.name == name)
            stack.enter_context(self._pause(topo, node))
            group.paused[name] = stack

    def _resume(self, group: _Group, only: EngineClient | None = None) -> None:
        for client in group.clients:
            if only is not None and client is not only:
                continue
            stack = group.paused.pop(client.node.name, None)
            if stack is not None:
                stack.close()

    def _stop(self, group: _Group) -> None:
        self._resume(group)
        self._groups.pop(group.key, None)
        if self._active is group:
            self._active = self._main
        for client in group.clients:
            client.before_use = None
        if group.topology is not None:
            group.topology.close()


def _unavailable(why: str) -> Exception:
    from bidir_kv.topology.base import BackendUnavailable

    return BackendUnavailable(why)


# ---- the small pair: D with a dozen blocks, policy recompute on both ----------------


@dataclass(frozen=True)
class Timing:
    """D's retention TTL on the small pair and the bound on any one wait there. The bound
    is well under the TTL, so a request that waits for retained blocks to expire shows as
    stalled."""

    ttl: float
    window: float


# vLLM answers a 400-token turn in about 1 s idle, under 10 s on a loaded 2-core box;
# its TTL must outlive a restart (40-180 s on 2 busy cores) for a conversation to span
# it; no scenario waits for it (turns are released)
_VLLM_TIMING = Timing(ttl=300.0, window=10.0)
SMALL_PAIR_TIMING = {
    "vllm-cpu": _VLLM_TIMING,
    "vllm-cpu+bidir-kv": _VLLM_TIMING,
    "emulator": Timing(ttl=10.0, window=4.0),
}
# D: 12 blocks, 11 usable (block 0 is the null block); prompts up to 1024 tokens
SMALL_D_BLOCKS, SMALL_MAX_MODEL_LEN = 12, 1024


def small_pair(
    backend: str,
    *,
    decode_kv: tuple[tuple[str, Any], ...] = (),
    emulator_args: tuple[str, ...] = (),
    decode_prefix_caching: bool = True,
) -> PairConfig:
    """The operational scenarios' pair (suites/conformance/test_operations.py), and any
    other scenario's that fits it: D with :data:`SMALL_D_BLOCKS` KV blocks and the
    backend's :data:`SMALL_PAIR_TIMING` TTL, ``kv_load_failure_policy: recompute`` on P
    and D (a failed read is a miss). ``decode_kv`` adds keys for D only."""
    kv = {
        "decoder_kv_blocks_ttl": SMALL_PAIR_TIMING[backend].ttl,
        "kv_load_failure_policy": "recompute",
    }
    return PairConfig(
        SMALL_D_BLOCKS,
        SMALL_MAX_MODEL_LEN,
        kv_items(kv),
        kv_items({**kv, **dict(decode_kv)}),
        tuple(emulator_args),
        decode_prefix_caching,
    )
