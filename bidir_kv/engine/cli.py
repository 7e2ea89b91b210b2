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

from bidir_kv.config import ConfigError, KVTransferConfig
from bidir_kv.engine.faults import FaultError, add_fault_flags, faults_from_args

__all__ = ["build_parser", "main"]

logger = logging.getLogger("bidir_kv.engine")
DEFAULT_CAPACITY_TOKENS = 262144


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bidir-kv engine",
        description="Emulated vLLM engine with NixlConnector semantics (bidirectional KV).",
    )
    p.add_argument("model", nargs="?", help="model name or path (only used as a label)")
    p.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
    )
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    # accepted for launch-script compatibility; they do not change the emulation
    p.add_argument("--max-num-seqs", type=int, default=256)
    for flag in ("--dtype", "--gpu-memory-utilization", "--seed",
                 "--tensor-parallel-size", "--uvicorn-log-level"):  # fmt: skip
        p.add_argument(flag, default=None, help="accepted, no effect in the emulator")
    p.add_argument("--enforce-eager", action="store_true", help="accepted, no effect")
    p.add_argument("--disable-log-requests", action="store_true", help="accepted, no effect")
    p.add_argument("--trust-remote-code", action="store_true", help="accepted, no effect")
    e = p.add_argument_group("emulator only")
    e.add_argument("--profile", default="tiny", help="cost-model profile name or JSON path")
    e.add_argument("--kv-bytes-per-token", type=int, default=None)
    e.add_argument("--kv-capacity-tokens", type=int, default=DEFAULT_CAPACITY_TOKENS)
    e.add_argument("--transport", choices=("auto", "nixl", "tcp"), default="auto")
    e.add_argument("--emulate-vllm", choices=("0.32", "0.33"), default="0.33")
    e.add_argument(
        "--kv-pairing",
        choices=("position", "suffix-trim"),
        default="position",
        help="how pulled remote blocks map to local ones; suffix-trim reproduces vLLM",
    )
    e.add_argument("--kv-metrics-log-interval", type=float, default=10.0, metavar="S")
    e.add_argument(
        "--kv-verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare pulled KV with the reader's own prompt (metric only; costs CPU)",
    )
    e.add_argument(
        "--kv-guard",
        choices=("hashes", "off"),
        default="hashes",
        help="cap pulls at the prefix the owner provably holds for this prompt (hashes), "
        "or trust the params like vLLM (off)",
    )
    add_fault_flags(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    model = ns.model or ns.model_flag
    if not model:
        parser.error("MODEL is required (positional or --model)")
    try:
        kv = KVTransferConfig.from_json(ns.kv_transfer_config)
        faults = faults_from_args(ns)
    except (ConfigError, FaultError) as exc:
        parser.error(str(exc))
    if ns.tensor_parallel_size not in (None, "1"):
        parser.error("--tensor-parallel-size: the emulator runs one rank; only 1 is supported")
    for name in ("block_size", "max_model_len", "kv_capacity_tokens", "max_num_seqs"):
        if getattr(ns, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if ns.max_num_batched_tokens is not None and ns.max_num_batched_tokens <= 0:
        parser.error("--max-num-batched-tokens must be positive")
    if ns.kv_bytes_per_token is not None and ns.kv_bytes_per_token <= 0:
        parser.error("--kv-bytes-per-token must be positive")
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
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
        stream=sys.stdout,
    )
    from bidir_kv.engine.app import EngineSettings

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
        max_num_batched_tokens=ns.max_num_batched_tokens or profile.max_num_batched_tokens,
        max_num_seqs=ns.max_num_seqs,
        kv_bytes_per_token=ns.kv_bytes_per_token or profile.kv_bytes_per_token,
        num_layers=profile.num_layers,
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
    )
    if settings.kv_bytes_per_token % settings.num_layers:
        parser.error(
            f"--kv-bytes-per-token ({settings.kv_bytes_per_token}) must be a multiple of the "
            f"profile's num_layers ({settings.num_layers})"
        )
    try:
        asyncio.run(_serve(settings))
    except StartupError as exc:
        print(f"bidir-kv engine: error: {exc}", file=sys.stderr)
        return 1
    return 0


class StartupError(RuntimeError):
    pass


async def _serve(settings: object) -> None:
    from bidir_kv.engine.app import run_engine
    from bidir_kv.engine.transport.base import TransportError

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)  # POSIX only, like vllm serve on CPU
    try:
        await run_engine(settings, stop)  # type: ignore[arg-type]
    except (TransportError, OSError) as exc:
        raise StartupError(str(exc)) from None
