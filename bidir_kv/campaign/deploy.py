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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bidir_kv.client import TransportError, fetch
from bidir_kv.config import KVTransferConfig
from bidir_kv.launch.process import ManagedProcess, wait_http_ok
from bidir_kv.topology.base import EngineSpec, Node, RouterSpec, TopologySpec
from bidir_kv.topology.local import LocalTopology, engine_argv

__all__ = ["Deployment", "EmulatedOptions", "read_rss_bytes", "start_emulated"]


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

    @property
    def local(self) -> bool:
        return self.topology is not None

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
        env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=node.host,
                   VLLM_NIXL_SIDE_CHANNEL_PORT=str(node.side_channel_port))  # fmt: skip
        starts = sum(1 for name in topo.procs if name.startswith(node.name)) + 1
        log = Path(str(node.log_path)).with_suffix(f".{starts}.log")
        proc = ManagedProcess(f"{node.name}-{starts}", engine_argv(spec, node.port,
                              node.info["engine_id"]), log, env=env)
        topo.procs[proc.name] = proc  # stopped with the topology
        proc.start()
        wait_http_ok(node.url + "/health", 60, alive=proc)
        node.info["pid"] = proc.pid
        return old.pid, proc.pid

    def close(self) -> None:
        for topo in (self.topology, self.reference):
            if topo is not None:
                topo.close()


@dataclass(frozen=True)
class EmulatedOptions:
    store: str = "memory"  # memory | redis
    profile: str = EngineSpec.profile
    transport: str = "tcp"
    num_decode: int = 1
    router_args: tuple[str, ...] = ()
    engine_args: tuple[str, ...] = ()
    run_dir: Path = Path("out/campaign")


def _kv(role: str) -> KVTransferConfig:
    return KVTransferConfig.from_dict({
        "kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True},
    })


def start_emulated(opts: EmulatedOptions) -> Deployment:
    """Start 1PnD + router (+ Redis) and a reference engine; the caller closes it."""
    engine = EngineSpec(profile=opts.profile, transport=opts.transport,
                        extra_args=opts.engine_args)
    spec = TopologySpec(
        num_decode=opts.num_decode,
        prefill=dataclasses.replace(engine, kv=_kv("kv_producer"), enable_prefix_caching=False),
        decode=dataclasses.replace(engine, kv=_kv("kv_consumer")),
        router=RouterSpec(extra_args=("--health-interval", "0.5", "--log-level", "warning",
                                      *opts.router_args)),
        redis=opts.store == "redis",
    )
    topo = LocalTopology(spec, opts.run_dir / "topology", timeout=60)
    ref_spec = TopologySpec(num_prefill=1, num_decode=0, routers=0,
                            prefill=EngineSpec(profile=opts.profile))
    ref = LocalTopology(ref_spec, opts.run_dir / "reference", timeout=60)
    dep = Deployment("", [], [], topology=topo, reference=ref)
    try:
        topo.start()
        ref.start()
    except BaseException:
        dep.close()
        raise
    dep.router_url = topo.router_url
    dep.prefill_urls = [n.url for n in topo.prefill]
    dep.decode_urls = [n.url for n in topo.decode]
    dep.reference_url = ref.prefill[0].url
    dep.router_pid = topo.procs["router-0"].pid
    dep.router_workers = _workers(opts.router_args)
    return dep


def _workers(argv: tuple[str, ...]) -> int:
    for i, arg in enumerate(argv):
        if arg.startswith("--workers="):
            return int(arg.split("=", 1)[1])
        if arg == "--workers" and i + 1 < len(argv):
            return int(argv[i + 1])
    return 1


def external(router_url: str, prefill: list[str], decode: list[str],
             reference: str | None, router_pid: int | None, workers: int = 1) -> Deployment:
    """A deployment someone else started (nothing is restarted or stalled)."""
    return Deployment(router_url.rstrip("/"), [u.rstrip("/") for u in prefill],
                      [u.rstrip("/") for u in decode],
                      reference.rstrip("/") if reference else None, router_pid=router_pid,
                      router_workers=workers)


def node_of(url: str) -> Node:
    host, _, port = url.removeprefix("http://").rpartition(":")
    return Node(role="prefill", name=url, host=host, port=int(port))
