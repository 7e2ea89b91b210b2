"""Emulated P/D engines (and routers, Redis) as processes on 127.0.0.1.

Every node is a :class:`ManagedProcess` with its own log under ``run_dir``, a free
HTTP port and, for engines, a free side-channel port passed through
``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT`` exactly as for ``vllm serve``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import secrets
import sys
import time
from pathlib import Path

from bidir_kv.launch.process import ManagedProcess, free_port, wait_http_ok
from bidir_kv.topology.base import (
    BackendUnavailable,
    EngineSpec,
    Node,
    Role,
    Topology,
    TopologySpec,
    engine_spec_with_peers,
)
from bidir_kv.topology.redis_server import RedisServer

__all__ = ["LocalTopology", "engine_argv"]

HOST = "127.0.0.1"


def engine_argv(spec: EngineSpec, port: int, engine_id: str) -> list[str]:
    """``bidir-kv engine`` command line for ``spec`` (flags as for ``vllm serve``)."""
    kv = dataclasses.replace(spec.kv, engine_id=engine_id)
    argv = [
        sys.executable,
        "-m",
        "bidir_kv",
        "engine",
        spec.model,
        "--host",
        HOST,
        "--port",
        str(port),
        "--served-model-name",
        spec.served_model_name,
        "--max-model-len",
        str(spec.max_model_len),
        "--block-size",
        str(spec.block_size),
        "--kv-transfer-config",
        kv.to_json(),
        "--profile",
        spec.profile,
        "--transport",
        spec.transport,
    ]
    if not spec.enable_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    if spec.emulate_vllm:
        argv += ["--emulate-vllm", spec.emulate_vllm]
    if spec.kv_capacity_tokens:
        argv += ["--kv-capacity-tokens", str(spec.kv_capacity_tokens)]
    if spec.kv_bytes_per_token:
        argv += ["--kv-bytes-per-token", str(spec.kv_bytes_per_token)]
    if spec.admin:
        argv.append("--enable-admin")
    return argv + list(spec.extra_args)


class LocalTopology(Topology):
    """``with LocalTopology(spec, run_dir) as topo: topo.prefill[0].url``."""

    backend = "local"

    def __init__(self, spec: TopologySpec, run_dir: str | Path, *, timeout: float = 30.0) -> None:
        super().__init__(spec)
        self.run_dir = Path(run_dir)
        self.timeout = timeout
        self.procs: dict[str, ManagedProcess] = {}
        self.redis: RedisServer | None = None
        self.startup_seconds: dict[str, float] = {}
        # Engine ids must be unique across every topology a process starts: a D keeps
        # its peers by engine id, so two topologies' "prefill-engine-000" would alias.
        self._id_tag = secrets.token_hex(3)

    # ---- engines -------------------------------------------------------------------

    def _engine_id(self, role: str, index: int) -> str:
        return f"{role}-engine-{index:03d}-{self._id_tag}"

    def engine_spec(self, role: str) -> EngineSpec:
        """The spec this topology starts (and restarts) ``role``'s engines with: the
        topology spec's, with its peer allowlist (TopologySpec.peer_allowlist): every
        engine of the other role, all on ``HOST``, so listed by that address."""
        return engine_spec_with_peers(self.spec, role, lambda r, i: (self._engine_id(r, i), HOST))

    def _start_engine(self, role: Role, index: int, spec: EngineSpec) -> Node:
        name = f"{role}-{index}"
        port, side = free_port(HOST), free_port(HOST)
        engine_id = self._engine_id(role, index)
        env = dict(os.environ)
        env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=HOST, VLLM_NIXL_SIDE_CHANNEL_PORT=str(side))
        env.update(dict(spec.env))
        log = self.run_dir / f"{name}.log"
        proc = ManagedProcess(name, engine_argv(spec, port, engine_id), log, env=env)
        self.procs[name] = proc
        proc.start()
        return Node(
            role=role,
            name=name,
            host=HOST,
            port=port,
            side_channel_port=side,
            log_path=str(log),
            info={"engine_id": engine_id, "pid": proc.pid, "started": time.perf_counter()},
        )

    def _wait_healthy(self, nodes: list[Node]) -> None:
        for node in nodes:
            wait_http_ok(node.url + "/health", self.timeout, alive=self.procs[node.name])
            self.startup_seconds[node.name] = time.perf_counter() - node.info["started"]

    # ---- routers -------------------------------------------------------------------

    def _start_router(self, index: int, store: str) -> Node:
        try:
            importlib.import_module("bidir_kv.router.cli")
        except ImportError as exc:
            raise BackendUnavailable(
                f"routers requested but bidir_kv.router.cli does not import ({exc})"
            ) from None
        r = self.spec.router
        name = f"router-{index}"
        port = free_port(HOST)
        argv = [
            sys.executable,
            "-m",
            "bidir_kv",
            "proxy",
            "--host",
            HOST,
            "--port",
            str(port),
            "--prefiller-hosts",
            *[n.host for n in self.prefill],
            "--prefiller-ports",
            *[str(n.port) for n in self.prefill],
            "--decoder-hosts",
            *[n.host for n in self.decode],
            "--decoder-ports",
            *[str(n.port) for n in self.decode],
            "--cache-ttl",
            str(r.cache_ttl),
            "--decoder-kv-blocks-ttl",
            str(self.spec.decode.kv.decoder_kv_blocks_ttl),
            "--store",
            store,
        ]
        if r.decode_stream != "always":
            argv += ["--decode-stream", r.decode_stream]
        argv += list(r.extra_args)
        log = self.run_dir / f"{name}.log"
        proc = ManagedProcess(name, argv, log)
        self.procs[name] = proc
        proc.start()
        return Node(
            role="router",
            name=name,
            host=HOST,
            port=port,
            log_path=str(log),
            info={"pid": proc.pid, "started": time.perf_counter()},
        )

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> LocalTopology:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        s = self.spec
        pspec, dspec = self.engine_spec("prefill"), self.engine_spec("decode")
        self.prefill = [self._start_engine("prefill", i, pspec) for i in range(s.num_prefill)]
        self.decode = [self._start_engine("decode", i, dspec) for i in range(s.num_decode)]
        self._wait_healthy([*self.prefill, *self.decode])
        if s.routers > 0:
            store = s.router.store
            if s.redis:
                server = RedisServer(self.run_dir).start()
                self.redis = server
                node = Node(role="store", name="redis", host=server.host, port=server.port)
                node.info["url"] = server.url
                self.stores.append(node)
                store = server.url
            self.routers = [self._start_router(i, store) for i in range(s.routers)]
            self._wait_healthy(self.routers)
        return self

    def node(self, name: str) -> Node:
        for n in self.nodes():
            if n.name == name:
                return n
        raise KeyError(name)

    def process(self, name: str) -> ManagedProcess:
        return self.procs[name]

    def restart(self, node: Node) -> None:
        """Stop an engine and start it again as a deploy would: same engine id, HTTP
        and side-channel ports and flags; a new process, data port and KV blocks."""
        self.procs[node.name].stop()
        spec = self.engine_spec(node.role)
        env = dict(os.environ)
        env.update(
            VLLM_NIXL_SIDE_CHANNEL_HOST=node.host,
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(node.side_channel_port),
        )
        env.update(dict(spec.env))
        runs = int(node.info.get("restarts", 0)) + 1
        log = self.run_dir / f"{node.name}.restart{runs}.log"
        proc = ManagedProcess(
            node.name, engine_argv(spec, node.port, node.info["engine_id"]), log, env=env
        )
        self.procs[node.name] = proc
        proc.start()
        wait_http_ok(node.url + "/health", self.timeout, alive=proc)
        node.log_path, node.info["restarts"], node.info["pid"] = str(log), runs, proc.pid

    def close(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
