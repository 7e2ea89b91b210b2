"""The two legs of a sweep as topology specs, and starting them through ``bidir_kv.topology``.

OFF and ON differ only in ``bidirectional_kv_xfer`` (on both engines, as vLLM
requires). P runs with prefix caching off in both legs, as in the AWS blog, so P
models a node that evicted the conversation; D keeps its prefix cache.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from bidir_kv.config import KVTransferConfig
from bidir_kv.launch.process import ManagedProcess, free_port, wait_http_ok
from bidir_kv.policy import (
    DEFAULT_DECODER_KV_BLOCKS_TTL,
    DEFAULT_RECOMPUTE_THRESHOLD,
    scaled_cache_ttl,
)
from bidir_kv.topology import BackendUnavailable, EngineSpec, RouterSpec, Topology, TopologySpec

__all__ = ["LegSetup", "leg_spec", "node_urls", "router_cache_ttl", "start_leg"]

TOPOLOGIES = ("emulator", "vllm-cpu")


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
    engine_args: tuple[str, ...] = ()  # extra `bidir-kv engine` flags (emulator topology)
    log_dir: Path = Path("out/bench-logs")


def router_cache_ttl(decoder_ttl: float) -> float:
    """The router's cache TTL stays below D's TTL, in the upstream ratio (450 s under 480 s)."""
    return scaled_cache_ttl(decoder_ttl, _ROUTER.cache_ttl)


def leg_spec(leg: str, setup: LegSetup) -> TopologySpec:
    if leg not in ("off", "on"):
        raise ValueError(f"leg must be 'off' or 'on', got {leg!r}")
    on = leg == "on"

    def kv(role: str, engine_id: str) -> KVTransferConfig:
        return KVTransferConfig.from_dict(
            {
                "kv_connector": "NixlConnector",
                "kv_role": role,
                "engine_id": engine_id,
                "kv_load_failure_policy": setup.kv_load_failure_policy,
                "kv_connector_extra_config": {
                    "bidirectional_kv_xfer": on,
                    "kv_recompute_threshold": setup.kv_recompute_threshold,
                    "decoder_kv_blocks_ttl": setup.decoder_kv_blocks_ttl,
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
            common, kv=kv("kv_producer", "prefill-engine-001"), enable_prefix_caching=False
        ),
        decode=replace(common, kv=kv("kv_consumer", "decode-engine-001")),
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
        return LocalTopology(spec, setup.log_dir / leg)
    if setup.topology == "vllm-cpu":
        from bidir_kv.topology.vllm_cpu import VllmCpuOptions, VllmCpuTopology

        return VllmCpuTopology(spec, VllmCpuOptions(log_dir=setup.log_dir / leg))
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
        sys.executable, "-m", "bidir_kv", "proxy",
        "--host", "127.0.0.1", "--port", str(port),
        "--prefiller-hosts", *(n.host for n in topo.prefill),
        "--prefiller-ports", *(str(n.port) for n in topo.prefill),
        "--decoder-hosts", *(n.host for n in topo.decode),
        "--decoder-ports", *(str(n.port) for n in topo.decode),
        "--cache-ttl", str(rspec.cache_ttl),
        "--decoder-kv-blocks-ttl", str(decoder_ttl),
        "--decode-stream", rspec.decode_stream,
        "--block-size", str(getattr(topo, "block_size", None) or topo.spec.prefill.block_size),
        *rspec.extra_args,
    ]  # fmt: skip
    proc = ManagedProcess("router-0", argv, log).start()
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 30.0, alive=proc)
    except BaseException:
        proc.stop()
        raise
    topo.routers.append(
        Node(role="router", name="router-0", host="127.0.0.1", port=port, log_path=str(log))
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
