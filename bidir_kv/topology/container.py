"""Emulated P/D engines and routers, each in its own Docker container.

Same :class:`~bidir_kv.topology.base.Topology` as the local backend, but every
node has its own network namespace, IP address and hostname on a private,
user-defined Docker network, so the router reaches engines, and engines reach
each other's side channel, by container name (``VLLM_NIXL_SIDE_CHANNEL_HOST``
is the container name). Only each node's HTTP port is published, on
127.0.0.1, for the test process.

Containers are started through testcontainers with Ryuk disabled and the
``docker_host`` connection mode (docs/containers.md §4.2) and ``init=True`` so a
SIGTERM stops the Python server at once. The image comes from
:mod:`bidir_kv.topology.container_image` (no registry needed).

Faults for tests: :meth:`ContainerTopology.kill` (SIGKILL a node),
:meth:`disconnect` / :meth:`reconnect` (pull a node off the network), and
:meth:`block_outbound` (reject connections one node opens to another, via
iptables in the node's network namespace; needs root on the host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bidir_kv.launch.process import ProcessFailed, wait_http_ok
from bidir_kv.topology.base import (
    BackendUnavailable,
    EngineSpec,
    Node,
    Role,
    Topology,
    TopologySpec,
    engine_spec_with_peers,
)
from bidir_kv.topology.container_image import ImageBuild, ensure_image
from bidir_kv.topology.container_manifest import IMAGE_PYTHON
from bidir_kv.topology.local import engine_argv

__all__ = ["HTTP_PORT", "LABEL", "SIDE_CHANNEL_PORT", "ContainerTopology", "testcontainers_env"]

HTTP_PORT = 8000  # inside every container (each has its own network namespace)
SIDE_CHANNEL_PORT = 5600  # vLLM's default VLLM_NIXL_SIDE_CHANNEL_PORT
LABEL = "org.bidir-kv.topology"  # on our containers and networks; ci/docker-cleanup.sh uses it


def testcontainers_env() -> None:
    """The two settings testcontainers needs on these machines (docs/containers.md §4.2).

    Ryuk's image cannot be pulled here, and ``/.dockerenv`` makes testcontainers
    believe it runs in a container. Applied before testcontainers is imported
    (it reads them at import time); our fixtures and finalizers do Ryuk's job.
    """
    os.environ["TESTCONTAINERS_RYUK_DISABLED"] = "true"
    os.environ["TESTCONTAINERS_CONNECTION_MODE"] = "docker_host"


class ContainerTopology(Topology):
    """``with ContainerTopology(spec, run_dir) as topo: topo.router_url``."""

    backend = "container"

    def __init__(
        self,
        spec: TopologySpec,
        run_dir: str | Path,
        *,
        image: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        super().__init__(spec)
        self.run_dir = Path(run_dir)
        self.timeout = timeout
        self.image = image
        self.image_build: ImageBuild | None = None
        self.prefix = f"bkv-{uuid.uuid4().hex[:8]}"
        self.network: Any = None
        self.containers: dict[str, Any] = {}
        self.startup_seconds: dict[str, float] = {}  # container start() -> /health 200
        self.start_call_seconds: dict[str, float] = {}  # testcontainers start() alone
        self._blocks: list[tuple[str, list[str]]] = []

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> ContainerTopology:
        if self.spec.redis:
            raise BackendUnavailable(
                "the container backend does not run a Redis store; use the local backend "
                "for spec.redis=True"
            )
        testcontainers_env()
        from testcontainers.core.network import Network

        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.image is None:
            self.image_build = ensure_image()
            self.image = self.image_build.tag
        net = Network(docker_network_kw={"labels": {LABEL: self.prefix}})
        net.name = f"{self.prefix}-net"
        self.network = net.create()
        s = self.spec
        pspec, dspec = self.engine_spec("prefill"), self.engine_spec("decode")
        jobs: list[tuple[Role, int, EngineSpec]] = [
            *[("prefill", i, pspec) for i in range(s.num_prefill)],
            *[("decode", i, dspec) for i in range(s.num_decode)],
        ]
        # container creation is I/O-bound on the daemon: start all engines at once
        with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
            futures = [pool.submit(self._start_engine, *job) for job in jobs]
            nodes = [f.result() for f in futures]
        self.prefill = [n for n in nodes if n.role == "prefill"]
        self.decode = [n for n in nodes if n.role == "decode"]
        self._wait_healthy([*self.prefill, *self.decode])
        if s.routers > 0:
            self.routers = [self._start_router(i) for i in range(s.routers)]
            self._wait_healthy(self.routers)
        return self

    def close(self) -> None:
        """Save every container's log to ``run_dir``, then remove containers and network."""
        for name in list(self.containers):
            with contextlib.suppress(Exception):
                self._save_log(name)
        for name, container in reversed(list(self.containers.items())):
            with contextlib.suppress(Exception):
                container.stop()
            self.containers.pop(name, None)
        if self.network is not None:
            with contextlib.suppress(Exception):
                self.network.remove()
            self.network = None

    # ---- nodes ---------------------------------------------------------------------

    def _container_name(self, role: str, index: int) -> str:
        return f"{self.prefix}-{role}-{index}"

    def _run(self, name: str, argv: list[str], env: dict[str, str]) -> Any:
        from testcontainers.core.container import DockerContainer

        assert self.image is not None
        container = (
            DockerContainer(self.image)
            .with_name(name)
            .with_command(argv)
            .with_envs(**env)
            .with_network(self.network)
            .with_network_aliases(name)
            .with_kwargs(init=True, hostname=name, labels={LABEL: self.prefix})
        )
        # publish the HTTP port on loopback only, on a port Docker picks
        ports: dict[str, Any] = container.ports  # docker-py takes (host_ip,) bindings too
        ports[f"{HTTP_PORT}/tcp"] = ("127.0.0.1",)
        self.containers[name] = container
        t0 = time.perf_counter()
        container.start()
        self.start_call_seconds[name] = time.perf_counter() - t0
        return container

    def _node(self, role: Role, name: str, container: Any, **info: Any) -> Node:
        port = int(container.get_exposed_port(HTTP_PORT))
        return Node(
            role=role,
            name=name,
            host="127.0.0.1",
            port=port,
            side_channel_port=SIDE_CHANNEL_PORT if role != "router" else None,
            log_path=str(self.run_dir / f"{name}.log"),
            info={
                "container": name,
                "container_id": container.get_wrapped_container().id,
                "internal_host": name,
                "internal_url": f"http://{name}:{HTTP_PORT}",
                "started": time.perf_counter(),
                **info,
            },
        )

    def engine_spec(self, role: str) -> EngineSpec:
        """The spec ``role``'s engines start with: the topology spec's, with its peer
        allowlist (TopologySpec.peer_allowlist): the other role's engines. Their host is
        their container name (the side-channel host, and the host the router rewrites
        ``remote_host`` to), which no allowlist entry matches (names are never
        resolved), so they are listed by engine id."""
        return engine_spec_with_peers(
            self.spec, role, lambda r, i: (f"{r}-engine-{i:03d}", self._container_name(r, i))
        )

    def _start_engine(self, role: Role, index: int, spec: EngineSpec) -> Node:
        name = self._container_name(role, index)
        engine_id = f"{role}-engine-{index:03d}"
        # The image carries no NIXL: "auto" would fall back to TCP anyway; say so.
        if spec.transport == "auto":
            spec = dataclasses.replace(spec, transport="tcp")
        argv = engine_argv(spec, HTTP_PORT, engine_id)
        argv[0] = IMAGE_PYTHON
        argv[argv.index("--host") + 1] = "0.0.0.0"
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": name,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(SIDE_CHANNEL_PORT),
            **dict(spec.env),
        }
        container = self._run(name, argv, env)
        return self._node(role, name, container, engine_id=engine_id)

    def _start_router(self, index: int) -> Node:
        r = self.spec.router
        name = self._container_name("router", index)
        argv = [
            IMAGE_PYTHON,
            "-m",
            "bidir_kv",
            "proxy",
            "--host",
            "0.0.0.0",
            "--port",
            str(HTTP_PORT),
            "--prefiller-hosts",
            *[n.name for n in self.prefill],
            "--prefiller-ports",
            *[str(HTTP_PORT) for _ in self.prefill],
            "--decoder-hosts",
            *[n.name for n in self.decode],
            "--decoder-ports",
            *[str(HTTP_PORT) for _ in self.decode],
            "--cache-ttl",
            str(r.cache_ttl),
            "--decoder-kv-blocks-ttl",
            str(self.spec.decode.kv.decoder_kv_blocks_ttl),
            "--store",
            r.store,
        ]
        if r.decode_stream != "always":
            argv += ["--decode-stream", r.decode_stream]
        argv += list(r.extra_args)
        container = self._run(name, argv, {})
        return self._node("router", name, container)

    def _wait_healthy(self, nodes: list[Node]) -> None:
        for node in nodes:
            self._wait_http_ok(node, "/health")
            self.startup_seconds[node.name] = time.perf_counter() - node.info["started"]

    def _wait_http_ok(self, node: Node, path: str) -> None:
        def gone() -> str | None:
            status = self.status(node.name)
            return None if status in ("created", "running") else f"container is {status}"

        try:
            wait_http_ok(node.url + path, self.timeout, gone=gone)
        except ProcessFailed as exc:
            logs = self.logs(node.name, tail=40)
            raise BackendUnavailable(f"{node.name}: {exc}\n{logs}") from None

    # ---- inspection ----------------------------------------------------------------

    def node(self, name: str) -> Node:
        for n in self.nodes():
            if n.name == name:
                return n
        raise KeyError(name)

    def container(self, name: str) -> Any:
        """The docker SDK container object of a node."""
        return self.containers[name].get_wrapped_container()

    def status(self, name: str) -> str:
        c = self.container(name)
        c.reload()
        return str(c.status)

    def ip(self, name: str) -> str:
        """The node's address on the topology network."""
        c = self.container(name)
        c.reload()
        return str(c.attrs["NetworkSettings"]["Networks"][self.network.name]["IPAddress"])

    def logs(self, name: str, tail: int | None = None) -> str:
        raw = self.container(name).logs(tail=tail if tail is not None else "all")
        return bytes(raw).decode(errors="replace")

    def _save_log(self, name: str) -> None:
        (self.run_dir / f"{name}.log").write_text(self.logs(name))

    # ---- faults --------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL the node's process tree (the container stays, stopped)."""
        self.container(name).kill()

    def _sdk_network(self, name: str) -> Any:
        return self.container(name).client.networks.get(self.network.name)

    def disconnect(self, name: str) -> None:
        """Pull the node off the topology network: nobody can reach it, nor it anyone."""
        self._sdk_network(name).disconnect(self.container(name).id)

    def reconnect(self, name: str) -> None:
        self._sdk_network(name).connect(self.container(name).id, aliases=[name])

    def block_outbound(self, src: str, dst: str) -> None:
        """Reject every TCP connection ``src`` opened to ``dst`` (new and established).

        Connections ``dst`` opened to ``src`` keep working (``--ctdir ORIGINAL``
        matches only packets in the direction of the connection's opener), so this
        cuts exactly one direction of the KV path, e.g. P's D->P readback while D
        still reads from P. Needs root on the host and iptables (docs/containers.md §5.7).
        """
        rule = [
            "OUTPUT",
            "-d",
            self.ip(dst),
            "-p",
            "tcp",
            "-m",
            "conntrack",
            "--ctdir",
            "ORIGINAL",
            "-j",
            "REJECT",
            "--reject-with",
            "tcp-reset",
        ]
        self._nsenter_iptables(src, ["-I", *rule])
        self._blocks.append((src, rule))

    def unblock_all(self) -> None:
        while self._blocks:
            src, rule = self._blocks.pop()
            with contextlib.suppress(BackendUnavailable):
                self._nsenter_iptables(src, ["-D", *rule])

    def _nsenter_iptables(self, name: str, args: list[str]) -> None:
        nsenter, iptables = shutil.which("nsenter"), shutil.which("iptables")
        if nsenter is None or iptables is None:
            raise BackendUnavailable("nsenter and iptables are needed to cut links in containers")
        c = self.container(name)
        c.reload()
        pid = int(c.attrs["State"]["Pid"])
        if pid <= 0:
            raise BackendUnavailable(f"container {name} is not running")
        proc = subprocess.run(
            [nsenter, "-t", str(pid), "-n", iptables, *args],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise BackendUnavailable(
                f"iptables {' '.join(args)} in {name}'s namespace failed: {proc.stderr.strip()}"
            )
