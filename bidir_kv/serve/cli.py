"""``bidir-kv serve``: one vLLM P or D node as the published recipe starts it.

    bidir-kv serve --role prefill --model M --ip P_IP --peer-ip D_IP --nixl-backend LIBFABRIC \\
        --tp 8 --cold-prefill --dry-run
    bidir-kv serve stop [--pidfile FILE | --run-dir DIR]
    bidir-kv serve --emit kubernetes --model M --nixl-backend LIBFABRIC --tp 8 --cold-prefill \\
        --image IMAGE > pd.yaml        # P and D as pods (bidir_kv/serve/kubernetes.py)

Without ``--dry-run`` the node starts in the background (its own session, log to a file),
``/health`` is awaited, and a pidfile in ``--run-dir`` lets ``serve stop`` clean up.

Every node gets ``bidir_kv_peer_allowlist`` naming its peer (``--peer-ip``, else the other
role's engine id; ``--peer-allowlist`` / ``--no-peer-allowlist`` change it; docs/hardware.md §1).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bidir_kv.config import CONNECTOR_MODULE_PATH
from bidir_kv.policy import (
    DEFAULT_DECODER_KV_BLOCKS_TTL,
    DEFAULT_RECOMPUTE_THRESHOLD,
    PeerAllowlist,
    peer_entries,
)
from bidir_kv.serve.command import (
    CONNECTORS,
    DEFAULT_PORTS,
    DEVICES,
    NIXL_BACKENDS,
    ServeCommand,
    ServeSpec,
    build,
)
from bidir_kv.wire.fence import ALLOWLIST_CONFIG_KEY

__all__ = ["main", "spec_from_args"]

DEFAULT_RUN_DIR = Path("out/serve")


def _on_off(text: str) -> bool:
    low = text.lower()
    if low not in ("on", "off", "true", "false"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return low in ("on", "true")


def _allowlist_arg(text: str) -> tuple[str, ...]:
    entries = tuple(e.strip() for e in text.split(",") if e.strip())
    try:
        PeerAllowlist.parse(list(entries))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return entries


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bidir-kv serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--role",
        choices=("prefill", "decode"),
        default=None,
        help="the node to start (required unless --emit kubernetes)",
    )
    p.add_argument(
        "--emit",
        choices=("kubernetes",),
        default=None,
        help="print P's and D's Kubernetes manifests (Pod + Service each) and start nothing",
    )
    p.add_argument(
        "--image",
        default="vllm/vllm-openai:latest",
        help="--emit kubernetes: the container image with vLLM and NIXL",
    )
    p.add_argument("--namespace", default="default", help="--emit kubernetes: namespace")
    p.add_argument(
        "--name",
        default="bidir-kv",
        help="--emit kubernetes: pods are NAME-prefill and NAME-decode",
    )
    p.add_argument(
        "--efa",
        type=int,
        default=16,
        help="--emit kubernetes: vpc.amazonaws.com/efa interfaces per pod",
    )
    p.add_argument("--model", required=True, help="model id or path (vllm serve's positional)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--bidir",
        type=_on_off,
        default=True,
        metavar="on|off",
        help="bidirectional_kv_xfer (must match on P and D; default on)",
    )
    p.add_argument(
        "--cold-prefill",
        action="store_true",
        help="--no-enable-prefix-caching on P (the recipe); D keeps its cache",
    )
    p.add_argument(
        "--ip",
        default="127.0.0.1",
        help="this node's address, exported as VLLM_NIXL_SIDE_CHANNEL_HOST",
    )
    p.add_argument(
        "--peer-ip",
        default=None,
        help="the other node's address (printed in the router hint, kept in the "
        "pidfile for `bidir-kv doctor`)",
    )
    p.add_argument("--host", default="0.0.0.0", help="HTTP bind address (default 0.0.0.0)")
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"HTTP port (default {DEFAULT_PORTS['prefill']} on P, {DEFAULT_PORTS['decode']} on D)",
    )
    p.add_argument(
        "--side-channel-port",
        type=int,
        default=5600,
        help="VLLM_NIXL_SIDE_CHANNEL_PORT (default 5600)",
    )
    p.add_argument("--tp", type=int, default=1, help="--tensor-parallel-size")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--kv-recompute-threshold", type=int, default=DEFAULT_RECOMPUTE_THRESHOLD)
    p.add_argument("--decoder-kv-blocks-ttl", type=float, default=DEFAULT_DECODER_KV_BLOCKS_TTL)
    p.add_argument(
        "--nixl-backend",
        choices=NIXL_BACKENDS,
        default="UCX",
        help="kv_connector_extra_config.backends (LIBFABRIC sets FI_PROVIDER=efa)",
    )
    p.add_argument("--device", choices=DEVICES, default="cuda")
    p.add_argument(
        "--gpus",
        default=None,
        metavar="IDS",
        help="accelerators for this node: CUDA_VISIBLE_DEVICES, "
        "NEURON_RT_VISIBLE_CORES or VLLM_CPU_OMP_THREADS_BIND by --device",
    )
    p.add_argument(
        "--connector",
        choices=CONNECTORS,
        default="stock",
        help="stock: vLLM's NixlConnector (default); bidir-kv: ours, loaded by "
        f"kv_connector_module_path {CONNECTOR_MODULE_PATH} (fenced early release, "
        "retention budget, peer allowlist; it must import in vLLM's Python)",
    )
    p.add_argument(
        "--engine-id",
        default=None,
        help="engine_id (default prefill-engine-001 / decode-engine-001)",
    )
    p.add_argument(
        "--no-kv-rank",
        dest="kv_rank",
        action="store_false",
        help="leave out the recipe's kv_rank/kv_parallel_size keys",
    )
    allow = p.add_mutually_exclusive_group()
    allow.add_argument(
        "--peer-allowlist",
        type=_allowlist_arg,
        default=None,
        metavar="LIST",
        help="bidir_kv_peer_allowlist: comma-separated engine ids and/or IP "
        "networks this node reads KV from (default: --peer-ip, else the other "
        "role's engine id; with --emit kubernetes the other pod's engine id)",
    )
    allow.add_argument(
        "--no-peer-allowlist",
        dest="peer_allow",
        action="store_false",
        help="leave bidir_kv_peer_allowlist unset: read KV from any peer the "
        "params name (vLLM's behaviour)",
    )
    p.add_argument("--nixl-debug", action="store_true", help="NIXL_LOG_LEVEL=DEBUG (rail lines)")
    p.add_argument("--vllm", default="vllm", help="the vllm executable (default: on PATH)")
    p.add_argument(
        "--dry-run", action="store_true", help="print the command and env, start nothing"
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=DEFAULT_RUN_DIR,
        help=f"pidfiles and logs (default {DEFAULT_RUN_DIR})",
    )
    p.add_argument(
        "--log-file",
        type=Path,
        default=None,
        help="server log (default <run-dir>/<role>-<port>.log)",
    )
    p.add_argument(
        "--health-timeout",
        type=float,
        default=1800.0,
        help="seconds to wait for /health (large models load for minutes)",
    )
    p.add_argument(
        "--no-wait",
        dest="wait",
        action="store_false",
        help="return once started, without waiting for /health",
    )
    p.add_argument(
        "extra", nargs=argparse.REMAINDER, help="after --: more vllm serve flags, passed through"
    )
    return p


def _other(role: str) -> str:
    return "decode" if role == "prefill" else "prefill"


def _default_allowlist(
    ns: argparse.Namespace, peer_engine: str, peer_host: str | None
) -> tuple[str, ...] | None:
    """--no-peer-allowlist: unset; --peer-allowlist: that; else the peer serve knows, by
    its address when it has one (bidir_kv.policy.peer_entries)."""
    if not ns.peer_allow:
        return None
    if ns.peer_allowlist is not None:
        return tuple(ns.peer_allowlist)
    return peer_entries([(peer_engine, peer_host)])


def spec_from_args(ns: argparse.Namespace) -> ServeSpec:
    extra = list(ns.extra)
    if extra and extra[0] == "--":
        extra = extra[1:]
    rank = (0 if ns.role == "prefill" else 1) if ns.kv_rank else None
    peer_engine = f"{_other(ns.role)}-engine-001" if ns.role else ""
    return ServeSpec(
        role=ns.role,
        model=ns.model,
        served_model_name=ns.served_model_name,
        bidir=ns.bidir,
        cold_prefill=ns.cold_prefill,
        ip=ns.ip,
        host=ns.host,
        port=ns.port,
        side_channel_port=ns.side_channel_port,
        tp=ns.tp,
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        dtype=ns.dtype,
        block_size=ns.block_size,
        enforce_eager=ns.enforce_eager,
        kv_recompute_threshold=ns.kv_recompute_threshold,
        decoder_kv_blocks_ttl=ns.decoder_kv_blocks_ttl,
        nixl_backend=ns.nixl_backend,
        device=ns.device,
        engine_id=ns.engine_id,
        kv_rank=rank,
        kv_parallel_size=2 if ns.kv_rank else None,
        visible=ns.gpus,
        nixl_debug=ns.nixl_debug,
        vllm=ns.vllm,
        extra_args=tuple(extra),
        connector=ns.connector,
        peer_allowlist=_default_allowlist(ns, peer_engine, ns.peer_ip),
    )


def _passed_kv_config(extra: Sequence[str]) -> str | None:
    """The last ``--kv-transfer-config`` among the flags after ``--`` (vLLM reads the last)."""
    found = None
    for i, arg in enumerate(extra):
        if arg == "--kv-transfer-config" and i + 1 < len(extra):
            found = extra[i + 1]
        elif arg.startswith("--kv-transfer-config="):
            found = arg.partition("=")[2]
    return found


def _with_passed_config(spec: ServeSpec, ns: argparse.Namespace) -> tuple[ServeSpec, list[str]]:
    """A ``--kv-transfer-config`` after ``--`` replaces serve's whole config (vLLM reads
    the last flag), so its ``bidir_kv_peer_allowlist`` wins. ValueError when it clashes
    with ``--peer-allowlist``; a note when it drops serve's default allowlist."""
    text = _passed_kv_config(spec.extra_args)
    if text is None:
        return spec, []
    try:
        own = json.loads(text)
        extra = own.get("kv_connector_extra_config") or {}
        given = extra.get(ALLOWLIST_CONFIG_KEY)
    except (ValueError, AttributeError):
        raise ValueError("the --kv-transfer-config after -- is not a JSON object") from None
    module = own.get("kv_connector_module_path")
    if ns.connector == "bidir-kv" and module != CONNECTOR_MODULE_PATH:
        where = "has none" if module is None else f"has {module!r}"
        raise ValueError(
            f"--connector bidir-kv clashes with the --kv-transfer-config after -- (it "
            f'replaces serve\'s and {where}); add "kv_connector_module_path": '
            f'"{CONNECTOR_MODULE_PATH}" to it, or leave --connector out'
        )
    explicit = ns.peer_allowlist is not None
    if explicit and given != list(ns.peer_allowlist):
        where = "has none" if given is None else f"has {given!r}"
        raise ValueError(
            f"--peer-allowlist {','.join(ns.peer_allowlist)} clashes with the "
            f"--kv-transfer-config after -- (it replaces serve's and {where}); give "
            f"{ALLOWLIST_CONFIG_KEY} once"
        )
    # serve's own config is replaced: its allowlist would only mislead a reader
    spec = replace(spec, peer_allowlist=None)
    if given is None and ns.peer_allow:
        return spec, [
            f"the --kv-transfer-config after -- replaces serve's (vLLM reads the "
            f"last) and sets no {ALLOWLIST_CONFIG_KEY}: this node reads KV from "
            "any peer; add the key to it, or pass --no-peer-allowlist"
        ]
    return spec, []


def _with_notes(cmd: ServeCommand, notes: Sequence[str]) -> ServeCommand:
    return replace(cmd, notes=(*notes, *cmd.notes)) if notes else cmd


def _router_hint(spec: ServeSpec, peer: str | None) -> str | None:
    if peer is None:
        return None
    p_ip, d_ip = (spec.ip, peer) if spec.role == "prefill" else (peer, spec.ip)
    return (
        f"router: bidir-kv proxy --prefiller-host {p_ip} --prefiller-port "
        f"{DEFAULT_PORTS['prefill']} --decoder-host {d_ip} --decoder-port "
        f"{DEFAULT_PORTS['decode']} --decoder-kv-blocks-ttl {spec.decoder_kv_blocks_ttl:g}"
    )


def _stop_main(argv: Sequence[str]) -> int:
    from bidir_kv.launch.pidfile import stop, stop_all

    p = argparse.ArgumentParser(
        prog="bidir-kv serve stop", description="stop nodes that `bidir-kv serve` started"
    )
    p.add_argument("--pidfile", type=Path, default=None)
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    p.add_argument("--timeout", type=float, default=30.0)
    ns = p.parse_args(list(argv))
    lines = [stop(ns.pidfile, ns.timeout)] if ns.pidfile else stop_all(ns.run_dir, ns.timeout)
    for line in lines or [f"no pidfiles in {ns.run_dir}"]:
        print(line)
    return 0


def _emit_kubernetes(ns: argparse.Namespace) -> int:
    from bidir_kv.serve.kubernetes import KubeOptions, manifests, render

    if ns.engine_id is not None:
        # one id for two engines: the pods' allowlists and the router could not tell
        # P from D, and each pod would admit itself as its own peer
        print(
            f"bidir-kv serve: --engine-id {ns.engine_id!r} names one engine, but --emit "
            "kubernetes writes two pods (prefill and decode) that need different ids; "
            "leave it out (prefill-engine-001 and decode-engine-001)",
            file=sys.stderr,
        )
        return 2
    specs = []
    for role in ("prefill", "decode"):
        one = spec_from_args(argparse.Namespace(**{**vars(ns), "role": role}))
        specs.append(replace(one, host="0.0.0.0"))
    # Pod IPs are known only once the pods run, and a router names them by Service:
    # each pod's default list is the other pod's engine id (docs/hardware.md §3)
    specs = [
        replace(s, peer_allowlist=_default_allowlist(ns, other.engine, None))
        for s, other in zip(specs, reversed(specs), strict=True)
    ]
    opts = KubeOptions(image=ns.image, namespace=ns.namespace, name=ns.name, efa=ns.efa)
    try:
        specs = [_with_passed_config(s, ns)[0] for s in specs]
        print(render(manifests(specs, opts)), end="")
    except ValueError as exc:
        print(f"bidir-kv serve: {exc}", file=sys.stderr)
        return 2
    if ns.connector == "bidir-kv":
        print(
            f"bidir-kv serve: note: the pods load kv_connector_module_path "
            f"{CONNECTOR_MODULE_PATH}; the image ({ns.image}) must contain bidir-kv",
            file=sys.stderr,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "stop":
        return _stop_main(args[1:])
    parser = _parser()
    ns = parser.parse_args(args)
    if ns.emit == "kubernetes":
        return _emit_kubernetes(ns)
    if ns.role is None:
        parser.error("--role is required (or --emit kubernetes for both roles)")
    spec = spec_from_args(ns)
    try:
        spec, notes = _with_passed_config(spec, ns)
        cmd = _with_notes(build(spec), notes)
    except ValueError as exc:
        print(f"bidir-kv serve: {exc}", file=sys.stderr)
        return 2
    hint = _router_hint(spec, ns.peer_ip)
    if ns.dry_run:
        print(cmd.shell())
        if hint:
            print(f"# {hint}")
        return 0
    for note in cmd.notes:
        print(f"bidir-kv serve: note: {note}", file=sys.stderr)
    from bidir_kv.launch.pidfile import launch
    from bidir_kv.launch.process import ProcessFailed

    port = spec.http_port
    log = ns.log_file or ns.run_dir / f"{spec.role}-{port}.log"
    pidfile = ns.run_dir / f"{spec.role}-{port}.pid"
    url = f"http://{'127.0.0.1' if spec.host in ('0.0.0.0', '::') else spec.host}:{port}"
    try:
        rec = launch(
            cmd,
            role=spec.role,
            url=url,
            log_path=log,
            pidfile=pidfile,
            health_timeout=ns.health_timeout,
            wait=ns.wait,
        )
    except (ProcessFailed, OSError) as exc:
        print(f"bidir-kv serve: {spec.role} did not come up: {exc}", file=sys.stderr)
        return 1
    print(f"{spec.role} serving at {rec.url} (pid {rec.pid}, log {rec.log}, pidfile {pidfile})")
    if hint:
        print(hint)
    return 0
