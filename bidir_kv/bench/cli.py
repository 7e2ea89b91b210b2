"""``bidir-kv bench``: the OFF/ON multi-turn TTFT sweep of the AWS blog, as one command.

Either launches each leg's topology itself (``--topology emulator|vllm-cpu``) or
measures a running deployment (``--url``, one leg per invocation). Writes one
vLLM-compatible stats JSON and one metrics-delta JSON per leg and point, and a
manifest; Ctrl-C stops cleanly and leaves a valid partial result. This module is
the command line; :mod:`bidir_kv.bench.sweep` runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bidir_kv.bench.args import distribution, int_list
from bidir_kv.bench.capacity import measure_capacity
from bidir_kv.bench.concurrency import run_concurrency
from bidir_kv.bench.distributions import DistributionError
from bidir_kv.bench.memory import DEFAULT_INTERVAL_S
from bidir_kv.bench.runner import RunOptions
from bidir_kv.bench.sweep import run_bench
from bidir_kv.bench.topo import CONNECTORS, STOCK, TOPOLOGIES, LegError, LegSetup, parse_connectors
from bidir_kv.bench.workload import HISTORY_MODES, WorkloadError, WorkloadSpec
from bidir_kv.engine.profiles import ProfileError
from bidir_kv.errors import PlanError
from bidir_kv.launch.process import ProcessFailed
from bidir_kv.plan.calprofile import write_profile
from bidir_kv.topology import BackendUnavailable

__all__ = ["BLOG_POINTS", "build_parser", "main"]

BLOG_POINTS = [2000, 4000, 8000, 12000, 16000, 20000, 24000]
# flag defaults are the defaults of what the flags configure
_LEG = LegSetup()
_WORK = WorkloadSpec()
_RUN = RunOptions(url="")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bidir-kv bench",
        description="Multi-turn TTFT sweep with bidirectional KV transfer OFF and ON.",
    )
    _target_args(ap)
    _workload_args(ap)
    _client_args(ap)
    _engine_args(ap)
    _output_args(ap)
    return ap


def _target_args(ap: argparse.ArgumentParser) -> None:
    tgt = ap.add_argument_group("target")
    tgt.add_argument(
        "--topology",
        choices=TOPOLOGIES,
        default=_LEG.topology,
        help="start each leg's 1P1D + router here (default: emulator)",
    )
    tgt.add_argument(
        "--profile",
        default=_LEG.profile,
        help="emulator cost profile: a shipped name or a JSON path",
    )
    tgt.add_argument(
        "-u",
        "--url",
        default=None,
        help="measure a running router instead (one leg per run, see --legs)",
    )
    tgt.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        metavar="ROLE=URL",
        help="with --url: node to scrape, e.g. prefill=http://p:8100, "
        "router=http://r:8000 (repeatable)",
    )
    tgt.add_argument(
        "--tokenize-url",
        default=None,
        help="with --url: a node with /tokenize (default: the prefill metrics URL)",
    )
    tgt.add_argument("-m", "--model", default=_LEG.model, help="served model name")
    tgt.add_argument(
        "--legs",
        default="off,on",
        help="legs to run, in order (default off,on; with --url exactly one)",
    )
    tgt.add_argument(
        "--connector",
        type=_connector_list,
        default=(STOCK,),
        metavar="NAME[,NAME]",
        help=f"vLLM KV connector on P and D (--topology vllm-cpu): {', '.join(CONNECTORS)} "
        "(bidir_kv.connector, docs/connector.md); two, e.g. stock,bidir-kv, compare them in "
        "one session: OFF runs with the first, ON once with each, as legs on and "
        "on+<second> (default: stock)",
    )


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1], got {text!r}")
    return value


def _connector_list(text: str) -> tuple[str, ...]:
    try:
        return parse_connectors(text)
    except LegError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--connector: ")) from None


def _workload_args(ap: argparse.ArgumentParser) -> None:
    wl = ap.add_argument_group("workload (defaults: the AWS blog's sweep)")
    wl.add_argument(
        "--prefix-tokens",
        type=int_list,
        default=BLOG_POINTS,
        help="sweep points: prefix tokens of each conversation's first message",
    )
    wl.add_argument("--num-conversations", type=int, default=_WORK.num_conversations)
    wl.add_argument("--num-turns", type=int, default=_WORK.num_turns)
    wl.add_argument(
        "--input-tokens", type=int, default=_WORK.input_tokens, help="tokens per user turn"
    )
    wl.add_argument(
        "--output-tokens", type=int, default=_WORK.output_tokens, help="max_tokens per answer"
    )
    wl.add_argument(
        "--think-time",
        type=distribution,
        default=_WORK.think_time,
        help="gap before turns 2+: const:S, uniform:A,B, exp:MEAN, "
        "lognormal:MEDIAN,SIGMA (default const:0)",
    )
    wl.add_argument(
        "--beyond-ttl-fraction",
        type=float,
        default=_WORK.beyond_ttl_fraction,
        help="fraction of gaps made longer than decoder_kv_blocks_ttl",
    )
    wl.add_argument(
        "--beyond-ttl-gap",
        type=float,
        default=None,
        help="length of those gaps in s (default 1.1 × TTL + 1)",
    )
    wl.add_argument("--seed", type=int, default=_WORK.seed)
    wl.add_argument(
        "--history",
        choices=HISTORY_MODES,
        default=_WORK.history,
        help="how each client sends the previous reply back in the next turn: verbatim "
        "(vLLM's benchmark), replaced (another text of as many words, as benchmarks that "
        "thread recorded replies), half (its first half), no-think (without its reasoning: "
        "the text after </think>, or its second half); default verbatim "
        "(docs/benchmarking.md)",
    )


def _client_args(ap: argparse.ArgumentParser) -> None:
    cl = ap.add_argument_group("clients")
    cl.add_argument("-p", "--num-clients", type=int, default=_RUN.num_clients)
    cl.add_argument(
        "-k", "--max-active-conversations", type=int, default=_RUN.max_active_conversations
    )
    cl.add_argument(
        "--send-conversation-id",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send conversation_id and X-Session-ID (vLLM's multi-turn benchmark's flag, "
        "off there by default); --no-send-conversation-id sends no id of any kind, as an "
        "unmodified client (the router then recognises turns by their history)",
    )
    cl.add_argument(
        "--return-token-ids",
        action=argparse.BooleanOptionalAction,
        default=_RUN.token_ids,
        help="ask for the reply's token ids (return_token_ids), so each row can say how many "
        "tokens were reusable; --no-return-token-ids sends vLLM's benchmark body exactly "
        "(reusable then unknown)",
    )
    cl.add_argument(
        "--concurrency",
        type=int_list,
        default=None,
        metavar="L[,L...]",
        help="run the OFF/ON sweep once per level: L clients and L active conversations (at "
        "least L conversations), into DIR/c<L>/; levels beyond the topology's capacity are "
        "left out (docs/benchmarking.md 'Concurrency sweep')",
    )
    cl.add_argument("--request-timeout-sec", type=float, default=_RUN.request_timeout_s)
    cl.add_argument(
        "--point-sleep",
        type=float,
        default=0.0,
        help="seconds to wait between points (the blog sleeps 20)",
    )


def _engine_args(ap: argparse.ArgumentParser) -> None:
    eng = ap.add_argument_group("engines (launched topologies)")
    eng.add_argument("--kv-recompute-threshold", type=int, default=_LEG.kv_recompute_threshold)
    eng.add_argument("--decoder-kv-blocks-ttl", type=float, default=_LEG.decoder_kv_blocks_ttl)
    eng.add_argument(
        "--kv-load-failure-policy",
        choices=("fail", "recompute"),
        default=_LEG.kv_load_failure_policy,
    )
    eng.add_argument("--block-size", type=int, default=_LEG.block_size)
    eng.add_argument(
        "--transport",
        choices=("auto", "nixl", "tcp"),
        default=_LEG.transport,
        help="emulator KV transport (default auto: NIXL when it imports)",
    )
    eng.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `bidir-kv proxy` (repeatable), e.g. "
        "--router-arg=--no-continuation-guard",
    )
    eng.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for both emulated engines (repeatable), e.g. "
        "--engine-arg=--no-kv-verify",
    )
    eng.add_argument(
        "--prefill-engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for P only (repeatable), e.g. "
        "--prefill-engine-arg=--kv-capacity-tokens=65536 (a finite P pool)",
    )
    eng.add_argument(
        "--decode-engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for D only (repeatable), e.g. "
        "--decode-engine-arg=--kv-capacity-tokens=131072 (a small D pool), "
        "--decode-engine-arg=--retained-blocks=pin (vLLM's pinned retention)",
    )
    eng.add_argument(
        "--prefill-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="P keeps its own prefix cache, as deployments run it (default off, as the "
        "publication: every turn then models a P that evicted the conversation)",
    )
    eng.add_argument(
        "--retention-budget",
        type=_share,
        default=None,
        metavar="S",
        help="D's bidir_kv_retention_budget: retained turns hold at most this share of its "
        "KV blocks (docs/connector.md §5.3; the emulator, or --connector bidir-kv)",
    )
    eng.add_argument(
        "--decode-stream",
        choices=("always", "never"),
        default=None,
        help="router D leg (default: always; never for vllm-cpu 0.32)",
    )


def _output_args(ap: argparse.ArgumentParser) -> None:
    out = ap.add_argument_group("output")
    out.add_argument(
        "-o", "--out", type=Path, default=None, help="result directory (default out/bench-<time>)"
    )
    out.add_argument(
        "--write-profile",
        type=Path,
        metavar="FILE",
        default=None,
        help="after the run, write its calibration as an emulator profile (docs/profiles.md §6)",
    )
    out.add_argument(
        "--memory-interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help="seconds between samples of D's KV usage and retained share while a "
        f"point runs (default {DEFAULT_INTERVAL_S:g}; 0: no samples)",
    )
    out.add_argument("--no-progress", dest="progress", action="store_false")
    out.add_argument(
        "--no-client-check",
        dest="client_check",
        action="store_false",
        help="skip measuring the client's own capacity after the run",
    )
    out.add_argument(
        "--check-client",
        action="store_true",
        help="only measure the client's capacity against a trivial server",
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lease"]:  # the renewable lease against the fixed TTL (docs/connector.md)
        from bidir_kv.bench.lease import main as lease_main

        return lease_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.check_client:
        cap = measure_capacity(clients=max(2, args.num_clients))
        print(json.dumps(cap.to_dict(), indent=1))
        return 0
    try:
        if (args.write_profile is not None or args.concurrency) and args.out is None:
            args.out = Path("out") / time.strftime("bench-%Y%m%d-%H%M%S")
        if args.concurrency:
            if args.write_profile is not None:
                raise LegError("--write-profile calibrates one run; not with --concurrency")
            if min(args.concurrency) < 1:
                raise LegError(f"--concurrency levels must be >= 1, got {args.concurrency}")
            return run_concurrency(args, run_bench)
        rc = run_bench(args)
        if rc == 0 and args.write_profile is not None:
            rc = _write_profile(args)
        return rc
    except (WorkloadError, DistributionError, BackendUnavailable, LegError) as exc:
        print(f"bidir-kv bench: {exc}", file=sys.stderr)
        return 2
    except ProcessFailed as exc:
        print(f"bidir-kv bench: a node failed to start or died: {exc}", file=sys.stderr)
        return 1


def _write_profile(args: argparse.Namespace) -> int:
    out: Path = args.out
    try:
        prof = write_profile(out, args.write_profile)
    except (PlanError, ProfileError) as exc:
        print(f"bidir-kv bench: cannot write a profile from {out}: {exc}", file=sys.stderr)
        return 1
    print(f"profile: {args.write_profile} ({prof.name}; bidir-kv engine --profile FILE)")
    return 0
