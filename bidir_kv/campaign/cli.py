"""``bidir-kv campaign``: load, fault and bad-input campaigns; one table; non-zero on failure.

By default it starts an emulated 1P1D behind ``bidir-kv proxy`` (``--store memory`` or
``redis``, a private ``redis-server``) plus a reference engine for the oracle, runs
the campaigns and stops everything. ``--router-url`` with ``--prefill-url`` and
``--decode-url`` runs against a deployment someone else started (docs/campaign.md).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bidir_kv.campaign.deploy import Deployment, EmulatedOptions, external, start_emulated
from bidir_kv.campaign.faults import FAULTS, FaultResult, run_faults
from bidir_kv.campaign.inputs import InputResult, run_inputs
from bidir_kv.campaign.load import LoadPlan, LoadResult, run_load
from bidir_kv.campaign.table import render
from bidir_kv.engine.settings import DEFAULT_PROFILE

__all__ = ["build_parser", "main"]

CAMPAIGNS = ("load", "faults", "inputs")
# The campaign's router gives up on a D leg after this (a stalled D answers 504 within
# it); the router's own default is 600 s, long for a campaign. Above the load p99 on a
# busy 2-core machine (~19 s seen at load average 14).
DECODE_TIMEOUT = 30.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bidir-kv campaign", description=__doc__)
    p.add_argument("--campaigns", nargs="+", choices=CAMPAIGNS, default=list(CAMPAIGNS))
    p.add_argument(
        "--conversations",
        type=int,
        default=LoadPlan.conversations,
        help="load: conversations, all at once",
    )
    p.add_argument("--turns", type=int, default=LoadPlan.turns, help="load: turns each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--min-hit-rate",
        type=float,
        default=0.99,
        help="load: lowest hit rate on turns >= 2 that passes (default 0.99)",
    )
    p.add_argument(
        "--faults",
        nargs="+",
        choices=list(FAULTS),
        default=list(FAULTS),
        help="faults to inject (default: all)",
    )
    g = p.add_argument_group("emulated topology (the default)")
    g.add_argument("--store", choices=("memory", "redis"), default="memory")
    g.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help="emulator cost profile (a shipped name or a JSON path)",
    )
    g.add_argument("--transport", default="tcp", help="emulator KV transport (tcp | nixl)")
    g.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="logs of every node (default: a fresh temporary directory)",
    )
    g.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for the router (repeatable, e.g. --router-arg=--workers=2)",
    )
    g.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for both emulated engines (repeatable), e.g. "
        "--engine-arg=--peer-cache=vllm to see a fault as vLLM 0.32 meets it",
    )
    e = p.add_argument_group("an existing deployment")
    e.add_argument("--router-url", default=None)
    e.add_argument("--prefill-url", nargs="+", default=[])
    e.add_argument("--decode-url", nargs="+", default=[])
    e.add_argument(
        "--reference-url",
        default=None,
        help="a non-disaggregated engine serving the same model (the oracle); "
        "without it answers are not checked",
    )
    e.add_argument("--router-pid", type=int, default=None, help="for the router's RSS")
    e.add_argument(
        "--router-workers",
        type=int,
        default=1,
        help="the router's --workers (above 1 the hit rate comes from P's READs)",
    )
    return p


def _deployment(args: argparse.Namespace) -> Deployment:
    if args.router_url:
        if not args.prefill_url or not args.decode_url:
            raise ValueError("--router-url needs --prefill-url and --decode-url")
        return external(
            args.router_url,
            args.prefill_url,
            args.decode_url,
            args.reference_url,
            args.router_pid,
            args.router_workers,
        )
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="bidir-kv-campaign-"))
    print(
        f"campaign: emulated 1P1D + router (store {args.store}, profile {args.profile}); "
        f"logs in {run_dir}",
        flush=True,
    )
    router_args = ("--decode-timeout", str(DECODE_TIMEOUT), *args.router_arg)
    return start_emulated(
        EmulatedOptions(
            store=args.store,
            profile=args.profile,
            transport=args.transport,
            router_args=router_args,
            engine_args=tuple(args.engine_arg),
            run_dir=run_dir,
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["wave"]:  # the D-full wave side by side (campaign/sidebyside.py)
        from bidir_kv.campaign.sidebyside import main as wave_main

        return wave_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.conversations <= 0 or args.turns <= 0:
        print(
            "bidir-kv campaign: error: --conversations and --turns must be positive",
            file=sys.stderr,
        )
        return 2
    try:
        dep = _deployment(args)
    except ValueError as exc:
        print(f"bidir-kv campaign: error: {exc}", file=sys.stderr)
        return 2
    try:
        load: list[LoadResult] = []
        faults: list[FaultResult] | None = None
        inputs: list[InputResult] | None = None
        if "load" in args.campaigns:
            plan = LoadPlan(conversations=args.conversations, turns=args.turns, seed=args.seed)
            print(f"load: {plan.conversations} x {plan.turns} ...", flush=True)
            load.append(run_load(dep, plan))
        if "faults" in args.campaigns:
            print(f"faults: {', '.join(args.faults)} ...", flush=True)
            faults = run_faults(dep, args.faults)
        if "inputs" in args.campaigns:
            print("bad inputs ...", flush=True)
            inputs = run_inputs(dep)
    finally:
        dep.close()
    print(render(load, faults, inputs, args.min_hit_rate))
    failed = (
        sum(1 for r in load if not r.holds(args.min_hit_rate))
        + sum(1 for f in faults or [] if not f.holds)
        + sum(1 for i in inputs or [] if not i.ok)
    )
    print("campaign: " + ("PASS" if not failed else f"FAIL ({failed} rows)"))
    return 0 if not failed else 1
