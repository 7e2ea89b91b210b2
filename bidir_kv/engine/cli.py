"""``bidir-kv engine MODEL ...``: flags mirror ``vllm serve``; emulator-only flags are marked.

Heavy work (numpy pool, transport, aiohttp) starts only after the flags parse, and
nixl is imported only when the NIXL transport is chosen, so a TCP engine answers
``/health`` well under a second after launch.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, get_args

from bidir_kv.config import ConfigError, KVTransferConfig
from bidir_kv.engine.faults import FaultError, add_fault_flags, faults_from_args
from bidir_kv.engine.settings import (
    DEFAULT_PROFILE,
    EngineSettings,
    Pairing,
    TransportChoice,
    VllmVersion,
)
from bidir_kv.errors import EngineError

__all__ = ["build_parser", "main"]

logger = logging.getLogger("bidir_kv.engine")
_default = EngineSettings.default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bidir-kv engine",
        description="Emulated vLLM engine with NixlConnector semantics (bidirectional KV).",
    )
    p.add_argument("model", nargs="?", help="model name or path (only used as a label)")
    p.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    p.add_argument("--host", default=_default("host"))
    p.add_argument("--port", type=int, default=_default("port"))
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--max-model-len", type=int, default=_default("max_model_len"))
    p.add_argument("--block-size", type=int, default=_default("block_size"))
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_default("enable_prefix_caching"),
    )
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON")
    p.add_argument("--max-num-batched-tokens", type=int, default=_default("max_num_batched_tokens"))
    p.add_argument("--max-num-seqs", type=int, default=_default("max_num_seqs"))
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=_default("enable_chunked_prefill"),
    )
    p.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=_default("tensor_parallel_size"),
        help="emulated ranks: KV bytes per rank = total / N (one process)",
    )
    p.add_argument(
        "--tokenizer",
        default=_default("tokenizer"),
        metavar="DIR",
        help="a local Hugging Face tokenizer directory (tokenizer.json); "
        "default: the builtin tokenizer",
    )
    for flag in ("--dtype", "--gpu-memory-utilization", "--seed", "--uvicorn-log-level"):
        p.add_argument(flag, default=None, help="accepted, no effect in the emulator")
    p.add_argument("--enforce-eager", action="store_true", help="accepted, no effect")
    p.add_argument("--disable-log-requests", action="store_true", help="accepted, no effect")
    p.add_argument("--trust-remote-code", action="store_true", help="accepted, no effect")
    _add_emulator_flags(p.add_argument_group("emulator only"))
    add_fault_flags(p)
    return p


def _add_emulator_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--profile", default=DEFAULT_PROFILE, help="cost-model profile name or JSON path"
    )
    group.add_argument("--kv-bytes-per-token", type=int, default=_default("kv_bytes_per_token"))
    group.add_argument("--kv-capacity-tokens", type=int, default=_default("kv_capacity_tokens"))
    group.add_argument(
        "--transport", choices=get_args(TransportChoice), default=_default("transport")
    )
    group.add_argument(
        "--emulate-vllm", choices=get_args(VllmVersion), default=_default("emulate_vllm")
    )
    group.add_argument(
        "--kv-pairing",
        choices=get_args(Pairing),
        default=_default("kv_pairing"),
        help="how pulled remote blocks map to local ones; suffix-trim reproduces vLLM",
    )
    group.add_argument(
        "--kv-metrics-log-interval",
        type=float,
        default=_default("metrics_log_interval"),
        metavar="S",
    )
    group.add_argument(
        "--kv-verify",
        action=argparse.BooleanOptionalAction,
        default=_default("kv_verify"),
        help="compare pulled KV with the reader's own prompt (metric only; costs CPU)",
    )
    group.add_argument(
        "--kv-cache-groups",
        default=_default("kv_cache_groups"),
        metavar="SPEC",
        help="the model's KV cache groups in vLLM's order, comma-separated 'full' or "
        "'sliding_window:W' (W tokens), exactly one full; several emulate vLLM's hybrid "
        "KV cache manager (layers split evenly, sliding blocks freed outside the window; "
        "docs/engine.md). Default: %(default)s",
    )
    group.add_argument(
        "--kv-guard",
        choices=("hashes", "off"),
        default="hashes" if _default("kv_guard") else "off",
        help="cap pulls at the prefix the owner provably holds for this prompt (hashes), "
        "or trust the params like vLLM (off)",
    )
    # operations (issue 16): safe defaults; "pin" and "vllm" reproduce vLLM 0.32
    from bidir_kv.engine.settings import PeerCache, RetainedBlocks

    group.add_argument(
        "--retained-blocks",
        choices=get_args(RetainedBlocks),
        default=_default("retained_blocks"),
        help="evict retained turns before new work waits, or pin them to TTL",
    )
    group.add_argument(
        "--max-waiting-seconds",
        type=float,
        metavar="S",
        default=_default("max_waiting_seconds"),
        help="a request queued this long fails with 503 (0: wait forever)",
    )
    group.add_argument(
        "--max-body-bytes",
        type=int,
        metavar="N",
        default=_default("max_body_bytes"),
        help="a larger request body is a 413 (bidir-kv only; vLLM has no limit)",
    )
    group.add_argument(
        "--health-stall-seconds",
        type=float,
        metavar="S",
        default=_default("health_stall_seconds"),
        help="/health is 503 when running work saw no step this long",
    )
    group.add_argument(
        "--enable-admin",
        dest="admin",
        action="store_true",
        help="serve /_emulator/faults and /_emulator/state to any caller (off by default: 403)",
    )
    group.add_argument(
        "--admin-token",
        default=os.environ.get("BIDIR_KV_ADMIN_TOKEN"),
        metavar="TOKEN",
        help="serve them to callers sending 'Authorization: Bearer TOKEN' "
        "(default: $BIDIR_KV_ADMIN_TOKEN)",
    )
    group.add_argument(
        "--peer-cache",
        choices=get_args(PeerCache),
        default=_default("peer_cache"),
        help="safe: re-handshake a restarted peer; vllm: keep it by engine id",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    settings = _settings(parser, ns)
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
        stream=sys.stdout,
    )
    try:
        asyncio.run(_serve(settings))
    except StartupError as exc:
        print(f"bidir-kv engine: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _check_sizes(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    names = (
        "tensor_parallel_size",
        "block_size",
        "max_model_len",
        "kv_capacity_tokens",
        "max_num_seqs",
    )
    for name in names:
        if getattr(ns, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if ns.max_num_batched_tokens is not None and ns.max_num_batched_tokens <= 0:
        parser.error("--max-num-batched-tokens must be positive")
    budget = ns.max_num_batched_tokens
    if budget is not None and not ns.enable_chunked_prefill and budget < ns.max_model_len:
        parser.error(  # vLLM's SchedulerConfig refuses the same combination
            f"max_num_batched_tokens ({budget}) is smaller than max_model_len "
            f"({ns.max_model_len}) with chunked prefill disabled; increase "
            "--max-num-batched-tokens or decrease --max-model-len"
        )
    if ns.kv_bytes_per_token is not None and ns.kv_bytes_per_token <= 0:
        parser.error("--kv-bytes-per-token must be positive")


def _settings(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> EngineSettings:
    """Validated settings from the parsed flags (exits 2 naming the problem)."""
    model = ns.model or ns.model_flag
    if not model:
        parser.error("MODEL is required (positional or --model)")
    try:
        kv = KVTransferConfig.from_json(ns.kv_transfer_config)
        faults = faults_from_args(ns)
    except (ConfigError, FaultError) as exc:
        parser.error(str(exc))
    _check_sizes(parser, ns)
    from bidir_kv.engine.profiles import ProfileError, load_profile

    try:
        profile = load_profile(ns.profile)
    except ProfileError as exc:
        parser.error(f"--profile: {exc}")
    from bidir_kv.engine.transport.sidechannel import side_channel_address

    try:
        side_host, side_port = side_channel_address(os.environ)
    except ValueError as exc:
        parser.error(str(exc))
    settings = EngineSettings(
        model=model,
        served_names=ns.served_model_name or [model],
        host=ns.host,
        port=ns.port,
        kv=kv,
        profile=profile,
        block_size=ns.block_size,
        enable_prefix_caching=ns.enable_prefix_caching,
        max_model_len=ns.max_model_len,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        max_num_seqs=ns.max_num_seqs,
        enable_chunked_prefill=ns.enable_chunked_prefill,
        kv_bytes_per_token=ns.kv_bytes_per_token,
        kv_capacity_tokens=ns.kv_capacity_tokens,
        transport=ns.transport,
        emulate_vllm=ns.emulate_vllm,
        kv_pairing=ns.kv_pairing,
        side_host=side_host,
        side_port=side_port,
        metrics_log_interval=ns.kv_metrics_log_interval,
        kv_verify=ns.kv_verify,
        kv_guard=ns.kv_guard == "hashes",
        faults=faults,
        **_ops(parser, ns),
        tensor_parallel_size=ns.tensor_parallel_size,
        tokenizer=ns.tokenizer,
        kv_cache_groups=ns.kv_cache_groups,
    )
    try:
        settings.group_layout  # noqa: B018 - parse and check once, before anything starts
    except ValueError as exc:
        parser.error(str(exc))
    per_rank = settings.num_layers * settings.tensor_parallel_size
    if settings.effective_kv_bytes_per_token % per_rank:
        parser.error(
            f"--kv-bytes-per-token ({settings.effective_kv_bytes_per_token}) must be a "
            f"multiple of num_layers x --tensor-parallel-size ({per_rank})"
        )
    return settings


def _ops(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> dict[str, Any]:
    from bidir_kv.engine.settings import ops_from_args

    try:
        return ops_from_args(ns)
    except ValueError as exc:
        parser.error(str(exc))


class StartupError(EngineError, RuntimeError):
    """The engine could not start (transport, port or tokenizer); the message says why."""


async def _serve(settings: EngineSettings) -> None:
    from bidir_kv.engine.app import run_engine
    from bidir_kv.engine.hf_tokenizer import TokenizerLoadError
    from bidir_kv.engine.transport.base import KVTransportError

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)  # POSIX only, like vllm serve on CPU
    try:
        await run_engine(settings, stop)
    except (KVTransportError, OSError, TokenizerLoadError) as exc:
        raise StartupError(str(exc)) from None
