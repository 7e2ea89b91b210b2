"""Topology specs and handles, independent of how nodes are started."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from bidir_kv.config import KVTransferConfig
from bidir_kv.engine.settings import DEFAULT_PROFILE, EngineSettings
from bidir_kv.errors import TopologyError
from bidir_kv.policy import peer_entries
from bidir_kv.router.settings import RouterSettings
from bidir_kv.wire.fence import ALLOWLIST_CONFIG_KEY

__all__ = [
    "BackendUnavailable",
    "EngineSpec",
    "Node",
    "RouterSpec",
    "Topology",
    "TopologySpec",
    "engine_spec_with_peers",
    "peer_allowlist",
]

Role = Literal["prefill", "decode", "router", "store"]


class BackendUnavailable(TopologyError):
    """The backend cannot run here (missing venv, no Docker, no URL); the message says what."""


@dataclass(frozen=True)
class EngineSpec:
    """How to start one engine. Fields mirror ``vllm serve`` flags.

    Defaults are the engine's own (:class:`~bidir_kv.engine.settings.EngineSettings`).
    """

    kv: KVTransferConfig = field(default_factory=KVTransferConfig)
    block_size: int = EngineSettings.default("block_size")
    enable_prefix_caching: bool = EngineSettings.default("enable_prefix_caching")
    max_model_len: int = EngineSettings.default("max_model_len")
    served_model_name: str = "tiny"
    model: str = "tiny"
    # emulator-only
    profile: str = DEFAULT_PROFILE
    transport: str = EngineSettings.default("transport")
    emulate_vllm: str | None = None
    kv_capacity_tokens: int | None = None
    kv_bytes_per_token: int | None = None
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    # --enable-admin: the engines a topology starts (test fixtures, the campaign, bench)
    # serve /_emulator/faults and /_emulator/state; a bare `bidir-kv engine` does not
    admin: bool = True


@dataclass(frozen=True)
class RouterSpec:
    """How to start a router (``bidir-kv proxy``); flags mirror the upstream multi-turn proxy.

    Defaults are the router's own (:class:`~bidir_kv.router.settings.RouterSettings`).
    """

    cache_ttl: float = RouterSettings.cache_ttl
    store: str = RouterSettings.store
    decode_stream: str = RouterSettings.decode_stream
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class TopologySpec:
    num_prefill: int = 1
    num_decode: int = 1
    prefill: EngineSpec = field(default_factory=EngineSpec)
    decode: EngineSpec = field(default_factory=EngineSpec)
    routers: int = 1
    router: RouterSpec = field(default_factory=RouterSpec)
    redis: bool = False
    # Each P's and D's bidir_kv_peer_allowlist: the topology's own nodes of the other role
    # (their address, or engine id where the host is a name: peer_allowlist below), unless
    # the engine spec's kv config names one (it wins). False leaves the key unset, vLLM's
    # behaviour: for a scenario that points a node at peers outside its topology.
    peer_allowlist: bool = True


def peer_allowlist(
    spec: TopologySpec, kv: KVTransferConfig, peers: Iterable[tuple[str | None, str | None]]
) -> tuple[str, ...] | None:
    """The list a topology gives a node whose kv config is ``kv`` and whose peers (the
    other role's nodes, ``(engine_id, host)``) are ``peers``: ``None`` (leave ``kv`` as it
    is) when ``spec.peer_allowlist`` is off, ``kv`` already names a list (the user's
    wins), or the topology has no node of the other role (a lone P variant reads from a
    D it did not start)."""
    if not spec.peer_allowlist or ALLOWLIST_CONFIG_KEY in kv.extra:
        return None
    return peer_entries(peers) or None


def engine_spec_with_peers(
    spec: TopologySpec, role: str, peer: Callable[[str, int], tuple[str | None, str | None]]
) -> EngineSpec:
    """The spec ``role``'s engines start with: ``spec``'s, with :func:`peer_allowlist`'s
    list (if any) in its kv config. ``peer(other_role, index)`` gives each node of the
    other role as ``(engine_id, host)``; the topology knows how it names them."""
    espec = spec.prefill if role == "prefill" else spec.decode
    other = "decode" if role == "prefill" else "prefill"
    count = spec.num_decode if other == "decode" else spec.num_prefill
    kv = espec.kv
    entries = peer_allowlist(spec, kv, [peer(other, i) for i in range(count)])
    if entries is None:
        return espec
    kv = dataclasses.replace(kv, extra={**kv.extra, ALLOWLIST_CONFIG_KEY: list(entries)})
    return dataclasses.replace(espec, kv=kv)


@dataclass
class Node:
    """A running node: how to reach it and where its log is."""

    role: Role
    name: str
    host: str
    port: int
    side_channel_port: int | None = None
    log_path: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


class Topology(abc.ABC):
    """A started set of nodes. Use as a context manager; ``close`` is idempotent."""

    backend: str = "abstract"  # how the nodes run: local, container, vllm-cpu, external

    def __init__(self, spec: TopologySpec) -> None:
        self.spec = spec
        self.prefill: list[Node] = []
        self.decode: list[Node] = []
        self.routers: list[Node] = []
        self.stores: list[Node] = []

    @abc.abstractmethod
    def start(self) -> Topology: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def restart(self, node: Node) -> None:
        """Stop ``node`` and start it again with the same identity and ports."""
        raise BackendUnavailable(f"the {self.backend} topology cannot restart nodes")

    @property
    def router_url(self) -> str:
        if not self.routers:
            raise BackendUnavailable(f"the {self.backend} topology has no router")
        return self.routers[0].url

    def nodes(self) -> list[Node]:
        return [*self.prefill, *self.decode, *self.routers, *self.stores]

    def __enter__(self) -> Topology:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
