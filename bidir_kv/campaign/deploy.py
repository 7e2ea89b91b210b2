"""What a campaign runs against: an emulated topology it starts, or a deployment given by URL.

The emulated default is 1P1D behind one ``bidir-kv proxy`` (memory store or a
private ``redis-server``), plus a plain engine as the oracle's non-disaggregated
reference. Given ``--router-url`` (and the engines' URLs) the campaign drives an
existing deployment instead; faults that need to restart or stall a process are then
reported as not tried.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bidir_kv.client import TransportError, fetch
from bidir_kv.config import CONNECTOR_MODULE_PATH, KVTransferConfig
from bidir_kv.launch.process import ManagedProcess, free_port, wait_http_ok
from bidir_kv.paths import REPO_ROOT
from bidir_kv.topology.base import EngineSpec, Node, RouterSpec, TopologySpec
from bidir_kv.topology.local import LocalTopology, engine_argv

__all__ = [
    "Deployment",
    "EmulatedOptions",
    "VllmOptions",
    "read_rss_bytes",
    "start_emulated",
    "start_vllm_cpu",
]


def read_rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` and its children (workers), from /proc; ``None`` off Linux."""
    total, seen = 0, False
    for p in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    seen = True
        except OSError:
            continue
    return total if seen else None


def children(pid: int) -> list[int]:
    """Child processes of ``pid`` (a router's workers), from /proc; [] off Linux."""
    return _children(pid)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@dataclass
class Deployment:
    """URLs of a router and its engines, and (when we started them) their processes."""

    router_url: str
    prefill_urls: list[str]
    decode_urls: list[str]
    reference_url: str | None = None
    topology: LocalTopology | None = None
    reference: LocalTopology | None = None
    router_pid: int | None = None
    router_workers: int = 1  # > 1: each /metrics scrape answers for one worker
    notes: list[str] = field(default_factory=list)
    # engines' log files by role, when this campaign knows them (vLLM topologies); an
    # emulated topology's are found in its run directory
    logs: dict[str, list[str]] = field(default_factory=dict)
    # the engines' counts of fence events come from their logs (vLLM with our connector:
    # they are not Prometheus series there), not from /metrics (the emulator)
    logs_count: bool = False
    closers: list[Callable[[], object]] = field(default_factory=list)  # stopped in close()

    @property
    def local(self) -> bool:
        return self.topology is not None

    def _logs(self, role: str) -> list[str]:
        if role in self.logs:
            return self.logs[role]
        if self.topology is None:
            return []
        return sorted(str(p) for p in self.topology.run_dir.glob(f"{role}-*.log"))

    @property
    def prefill_logs(self) -> list[str]:
        return self._logs("prefill")

    @property
    def decode_logs(self) -> list[str]:
        return self._logs("decode")

    def redis_pid(self) -> int | None:
        """The Redis server this campaign started, if any."""
        topo = self.topology
        return topo.redis.pid if topo is not None and topo.redis is not None else None

    def router_rss(self) -> int | None:
        return read_rss_bytes(self.router_pid) if self.router_pid else None

    def set_faults(self, url: str, **faults: Any) -> bool:
        """Set emulator faults on one engine; ``False`` when it has no fault endpoint."""
        try:
            return fetch(url + "/_emulator/faults", method="POST", json=faults).status == 200
        except TransportError:
            return False

    def restart(self, role: str, index: int = 0) -> tuple[int | None, int | None]:
        """Stop one engine and start it again as a deploy would: same engine id, same
        HTTP and side-channel ports, a new process (new data port, empty memory).
        Returns the old and the new process ids (the fault checks the one is gone and
        the other runs)."""
        topo = self.topology
        if topo is None:
            raise RuntimeError("restart needs an emulated topology this campaign started")
        node = (topo.prefill if role == "prefill" else topo.decode)[index]
        spec = topo.spec.prefill if role == "prefill" else topo.spec.decode
        old = topo.procs[node.name]
        old.stop()
        env = dict(os.environ)
        env.update(
            VLLM_NIXL_SIDE_CHANNEL_HOST=node.host,
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(node.side_channel_port),
        )
        starts = sum(1 for name in topo.procs if name.startswith(node.name)) + 1
        log = Path(str(node.log_path)).with_suffix(f".{starts}.log")
        proc = ManagedProcess(
            f"{node.name}-{starts}",
            engine_argv(spec, node.port, node.info["engine_id"]),
            log,
            env=env,
        )
        topo.procs[proc.name] = proc  # stopped with the topology
        proc.start()
        wait_http_ok(node.url + "/health", 60, alive=proc)
        node.info["pid"] = proc.pid
        return old.pid, proc.pid

    def close(self) -> None:
        try:
            for topo in (self.topology, self.reference):
                if topo is not None:
                    topo.close()
        finally:
            for stop in reversed(self.closers):
                stop()


@dataclass(frozen=True)
class EmulatedOptions:
    store: str = "memory"  # memory | redis
    profile: str = EngineSpec.profile
    transport: str = "tcp"
    num_decode: int = 1
    router_args: tuple[str, ...] = ()
    engine_args: tuple[str, ...] = ()
    run_dir: Path = Path("out/campaign")
    # the wave's variants (``bidir-kv campaign wave``): more kv_connector_extra_config
    # keys on both nodes and on D alone, flags for D alone, D's KV capacity, the router's
    # cache TTL (below D's decoder_kv_blocks_ttl), and whether to start the oracle's engine
    kv_extra: tuple[tuple[str, Any], ...] = ()
    decode_kv_extra: tuple[tuple[str, Any], ...] = ()
    decode_args: tuple[str, ...] = ()
    decode_capacity_tokens: int | None = None
    router_cache_ttl: float | None = None
    reference: bool = True


def _kv(role: str, **extra: Any) -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"bidirectional_kv_xfer": True, **extra},
        }
    )


def start_emulated(opts: EmulatedOptions) -> Deployment:
    """Start 1PnD + router (+ Redis) and a reference engine; the caller closes it."""
    engine = EngineSpec(profile=opts.profile, transport=opts.transport, extra_args=opts.engine_args)
    both = dict(opts.kv_extra)
    router = RouterSpec(
        extra_args=("--health-interval", "0.5", "--log-level", "warning", *opts.router_args)
    )
    if opts.router_cache_ttl is not None:
        router = dataclasses.replace(router, cache_ttl=opts.router_cache_ttl)
    spec = TopologySpec(
        num_decode=opts.num_decode,
        prefill=dataclasses.replace(
            engine, kv=_kv("kv_producer", **both), enable_prefix_caching=False
        ),
        decode=dataclasses.replace(
            engine,
            kv=_kv("kv_consumer", **both, **dict(opts.decode_kv_extra)),
            kv_capacity_tokens=opts.decode_capacity_tokens,
            extra_args=(*opts.engine_args, *opts.decode_args),
        ),
        router=router,
        redis=opts.store == "redis",
    )
    topo = LocalTopology(spec, opts.run_dir / "topology", timeout=60)
    ref = None
    if opts.reference:
        ref_spec = TopologySpec(
            num_prefill=1, num_decode=0, routers=0, prefill=EngineSpec(profile=opts.profile)
        )
        ref = LocalTopology(ref_spec, opts.run_dir / "reference", timeout=60)
    dep = Deployment("", [], [], topology=topo, reference=ref)
    try:
        topo.start()
        if ref is not None:
            ref.start()
    except BaseException:
        dep.close()
        raise
    dep.router_url = topo.router_url
    dep.prefill_urls = [n.url for n in topo.prefill]
    dep.decode_urls = [n.url for n in topo.decode]
    dep.reference_url = ref.prefill[0].url if ref is not None else None
    dep.router_pid = topo.procs["router-0"].pid
    dep.router_workers = _workers(opts.router_args)
    return dep


@dataclass(frozen=True)
class VllmOptions:
    """A vllm-cpu 1P1D (``bidir_kv.topology.vllm_cpu``) behind ``bidir-kv proxy``."""

    connector: bool = True  # kv_connector_module_path: bidir_kv.connector on P and D
    decode_blocks: int = 48  # D's KV blocks (--num-gpu-blocks-override; one is the null block)
    max_model_len: int = 2048
    ttl: float = 30.0  # decoder_kv_blocks_ttl
    router_cache_ttl: float = 28.0
    decode_kv_extra: tuple[tuple[str, Any], ...] = ()
    router_args: tuple[str, ...] = ()
    run_dir: Path = Path("out/campaign")


def start_vllm_cpu(opts: VllmOptions) -> Deployment:
    """Start vllm-cpu P and D (our connector or stock NixlConnector) and our router.

    Answers are not checked (no reference engine): the wave asks about time and reuse.
    P runs without prefix caching (every hit is history read from D), both nodes under
    ``kv_load_failure_policy: fail`` with our connector off (vLLM 0.32's ``recompute``
    stalls after a declined read, docs/conformance.md) and ``recompute`` with it (a read
    the fence discards is recomputed, docs/connector.md §5.4). The router calls D without
    streaming (vllm-cpu 0.32 returns no params on streams), so a client's first token
    comes with D's whole answer."""
    from bidir_kv.topology.vllm_cpu import VllmCpuOptions, VllmCpuTopology

    def kv(role: str, engine_id: str, **extra: Any) -> KVTransferConfig:
        top: dict[str, Any] = {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "kv_buffer_device": "cpu",
            "engine_id": engine_id,
            "kv_load_failure_policy": "recompute" if opts.connector else "fail",
            "kv_connector_extra_config": {
                "bidirectional_kv_xfer": True,
                "decoder_kv_blocks_ttl": opts.ttl,
                **extra,
            },
        }
        if opts.connector:
            top["kv_connector_module_path"] = CONNECTOR_MODULE_PATH
        return KVTransferConfig.from_dict(top)

    spec = TopologySpec(
        prefill=EngineSpec(
            kv=kv("kv_producer", "prefill-wave"),
            enable_prefix_caching=False,
            max_model_len=opts.max_model_len,
        ),
        decode=EngineSpec(
            kv=kv("kv_consumer", "decode-wave", **dict(opts.decode_kv_extra)),
            max_model_len=opts.max_model_len,
            extra_args=("--num-gpu-blocks-override", str(opts.decode_blocks)),
        ),
        routers=0,
    )
    vopts = VllmCpuOptions(
        log_dir=opts.run_dir / "vllm",
        python_path=(REPO_ROOT,) if opts.connector else (),  # our connector, from this checkout
    )
    topo = VllmCpuTopology(spec, vopts)
    dep = Deployment("", [], [], logs_count=True)
    dep.closers.append(topo.close)
    try:
        topo.start()
        p, d = topo.prefill[0], topo.decode[0]
        dep.prefill_urls, dep.decode_urls = [p.url], [d.url]
        dep.logs = {"prefill": [str(p.log_path)], "decode": [str(d.log_path)]}
        router, port = _router(p, d, opts, topo.block_size)
        dep.closers.append(router.stop)
    except BaseException:
        dep.close()
        raise
    dep.router_url, dep.router_pid = f"http://127.0.0.1:{port}", router.pid
    return dep


def _router(p: Node, d: Node, opts: VllmOptions, block_size: int) -> tuple[ManagedProcess, int]:
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
        p.host,
        "--prefiller-ports",
        str(p.port),
        "--decoder-hosts",
        d.host,
        "--decoder-ports",
        str(d.port),
        "--cache-ttl",
        str(opts.router_cache_ttl),
        "--decoder-kv-blocks-ttl",
        str(opts.ttl),
        "--decode-stream",
        "never",
        "--block-size",
        str(block_size),
        "--health-interval",
        "0.5",
        "--log-level",
        "warning",
        *opts.router_args,
    ]
    proc = ManagedProcess("router-0", argv, opts.run_dir / "router.log").start()
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 30.0, alive=proc)
    except BaseException:
        proc.stop()
        raise
    return proc, port


def _workers(argv: tuple[str, ...]) -> int:
    for i, arg in enumerate(argv):
        if arg.startswith("--workers="):
            return int(arg.split("=", 1)[1])
        if arg == "--workers" and i + 1 < len(argv):
            return int(argv[i + 1])
    return 1


def external(
    router_url: str,
    prefill: list[str],
    decode: list[str],
    reference: str | None,
    router_pid: int | None,
    workers: int = 1,
) -> Deployment:
    """A deployment someone else started (nothing is restarted or stalled)."""
    return Deployment(
        router_url.rstrip("/"),
        [u.rstrip("/") for u in prefill],
        [u.rstrip("/") for u in decode],
        reference.rstrip("/") if reference else None,
        router_pid=router_pid,
        router_workers=workers,
    )


def node_of(url: str) -> Node:
    host, _, port = url.removeprefix("http://").rpartition(":")
    return Node(role="prefill", name=url, host=host, port=int(port))
