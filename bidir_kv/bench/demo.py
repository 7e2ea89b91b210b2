"""``bidir-kv demo`` (``make demo``): the AWS blog's OFF/ON sweep on this machine in minutes.

Starts an emulated 1P1D + router with a realistic profile (default
``qwen3-32b-p5en``), runs the OFF leg and the ON leg, renders the report and the
two plots, and prints the table. Every process is started through
``bidir_kv.topology`` and stopped when its leg ends (also on Ctrl-C or errors).

The profile is *time-scaled* (``--time-scale``, default 3): every emulated
duration is multiplied, which keeps the recompute/transfer ratios of the target
while making them large against this machine's own per-request overhead
(tokenizing 24k-token prompts, moving the scaled KV bytes, HTTP).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bidir_kv.bench import cli as bench_cli
from bidir_kv.bench.report_cli import render_dir
from bidir_kv.engine.profiles import ProfileError, load_profile

__all__ = ["main", "scaled_profile"]


def scaled_profile(name: str, scale: float, out_dir: Path) -> Path:
    """Write ``name`` with ``time_scale`` multiplied by ``scale``; returns the JSON path."""
    prof = load_profile(name)
    scaled = replace(prof, name=f"{prof.name}-x{scale:g}", time_scale=prof.time_scale * scale)
    data = scaled.to_dict()
    data["derivation"] = (
        f"{prof.name} (fixtures/profiles, derivation in docs/profiles.md) with every emulated "
        f"duration multiplied by {scale:g} for this machine; ratios are unchanged."
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{scaled.name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bidir-kv demo",
        description="Emulated 1P1D + router, OFF/ON multi-turn TTFT sweep, report and plots.",
    )
    ap.add_argument(
        "--profile", default="qwen3-32b-p5en", help="cost profile (default qwen3-32b-p5en)"
    )
    ap.add_argument(
        "--time-scale",
        type=float,
        default=3.0,
        help="multiply emulated durations (default 3; 1 = the target's real time)",
    )
    ap.add_argument("--prefix-tokens", default="2000,8000,16000,24000")
    ap.add_argument("--num-conversations", type=int, default=2)
    ap.add_argument("--num-turns", type=int, default=4)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--num-clients", type=int, default=2)
    ap.add_argument(
        "--transport",
        choices=("auto", "nixl", "tcp"),
        default="tcp",
        help="emulator KV transport (default tcp: UCX progress threads compete for "
        "the 2 cores of a small machine)",
    )
    ap.add_argument("-o", "--out", type=Path, default=Path("out/demo"))
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.time_scale <= 0:
        ap.error("--time-scale must be > 0")
    t0 = time.monotonic()
    if args.out.exists():
        shutil.rmtree(args.out)
    try:
        profile_path = scaled_profile(args.profile, args.time_scale, args.out)
    except ProfileError as exc:
        print(f"bidir-kv demo: {exc}", file=sys.stderr)
        return 2
    print(
        f"bidir-kv demo: profile {args.profile} × {args.time_scale:g} time scale, "
        f"prefix lengths {args.prefix_tokens}, {args.num_conversations} conversations × "
        f"{args.num_turns} turns, {args.num_clients} clients",
        flush=True,
    )
    rc = bench_cli.main(_sweep_argv(args, profile_path))
    if rc != 0:
        print(
            f"bidir-kv demo: the sweep did not complete (exit {rc}); partial results in {args.out}",
            file=sys.stderr,
        )
        return rc
    _print_outcome(args.out)
    print(f"done in {time.monotonic() - t0:.0f} s; every process stopped")
    return 0


def _sweep_argv(args: argparse.Namespace, profile_path: Path) -> list[str]:
    """The ``bidir-kv bench`` arguments of the demo's sweep."""
    return [
        "--topology", "emulator",
        "--profile", str(profile_path),
        "--prefix-tokens", args.prefix_tokens,
        "--num-conversations", str(args.num_conversations),
        "--num-turns", str(args.num_turns),
        "--input-tokens", "150",
        "--output-tokens", str(args.output_tokens),
        "--num-clients", str(args.num_clients),
        "--max-active-conversations", str(args.num_conversations),
        "--transport", args.transport,
        "-o", str(args.out),
    ]  # fmt: skip


def _print_outcome(out: Path) -> None:
    """Render the report and print the table, the client's margin and where files are."""
    report, table = render_dir(out)
    print()
    print("TTFT median, turns >= 2 (OFF = recompute on P, ON = P pulls D's KV):")
    print(table)
    manifest = json.loads((out / "manifest.json").read_text())
    cap = manifest.get("client_capacity") or {}
    if cap:
        print(
            f"client capacity: {cap['requests_per_s']:.0f} req/s, "
            f"{cap['chunks_per_s']:.0f} chunks/s vs at most "
            f"{cap['needed_requests_per_s']:.1f} req/s, {cap['needed_chunks_per_s']:.0f} "
            f"chunks/s needed ({cap['margin']:.0f}× margin)"
        )
    print(f"report: {report}")
    print(f"plots:  {out / 'ttft.png'}  {out / 'prefill.png'}")
