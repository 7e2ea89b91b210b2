"""``bidir-kv calibrate``: measure a running P/D pair in minutes and write its cost profile.

The planner's terms of a deployment you run, without a sweep of its own
(docs/profiles.md §6): three prompt lengths, each measured OFF and ON through the
router in front of the pair, then fitted by the same fit as the published table
(:func:`bidir_kv.plan.calibrate.fit`) and written as a profile that ``plan``,
``bench`` and ``engine`` load.

How OFF and ON are measured on a deployment that runs with the feature on: each
length opens ``conversations`` new conversations. Their first turns are the OFF
point: D holds nothing of them yet, so P computes the whole prompt (what OFF does
to every turn). Their second turns are the ON point: D holds the first turn's prompt
and answer, P pulls it and computes the new message. The two phases are scraped
apart (the ``/metrics`` of every node before and after each), so each point's
transfer histogram, tokens by source and router prefill histogram are its own. One
client, one request at a time: no request waits for another's compute, so the fit
needs no contention term. The directory it writes is a ``bench`` result
(``plan --calibration DIR`` reads it again).

The run is bounded: ``--budget`` seconds for the whole command (default 180). After
each phase the time left is checked against an estimate of the phases still to
come (a line through the request latencies so far); when they would not fit, the
remaining lengths run fewer conversations, and when even one would not fit the
command stops and says which length to drop.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from bidir_kv.bench.args import int_list
from bidir_kv.bench.interrupt import Interrupt, run_point_interruptible
from bidir_kv.bench.results import ResultError, load_result
from bidir_kv.bench.runner import (
    ConversationState,
    HttpTokenCounter,
    RunOptions,
    metrics_delta,
    snapshot_nodes,
    write_point,
)
from bidir_kv.bench.stats import RequestRecord
from bidir_kv.bench.summary import summarize_result
from bidir_kv.bench.sweep import parse_metrics_urls, write_manifest
from bidir_kv.bench.workload import (
    Conversation,
    TokenCounter,
    WorkloadError,
    WorkloadSpec,
    build_conversations,
    count_words,
)
from bidir_kv.client import ClientError
from bidir_kv.engine.profiles import ProfileError
from bidir_kv.plan.calibrate import calibrate, check_rows
from bidir_kv.plan.calprofile import calibrated_profile
from bidir_kv.plan.fit import linear_fit
from bidir_kv.plan.planner import DEFAULT_BLOCK_SIZE, CostModel, PlanError

__all__ = [
    "CalibrationError",
    "LiveOptions",
    "LiveResult",
    "build_parser",
    "conversations_that_fit",
    "main",
    "measure",
]

PROG = "bidir-kv calibrate"
LEGS = ("off", "on")
MIN_LENGTHS = 3  # three lengths: two unknowns per fit and one to spare


class CalibrationError(PlanError):
    """A calibration that cannot be made as asked; the message says what to change."""


@dataclass(frozen=True)
class LiveOptions:
    """What to measure and how long it may take."""

    url: str  # the router in front of the pair
    nodes: Mapping[str, str]  # role<n> -> URL to scrape (prefill0 is required)
    model: str = "tiny"
    lengths: tuple[int, ...] = (256, 1024, 2048)
    conversations: int = 4
    input_tokens: int = 64
    output_tokens: int = 8
    budget_s: float = 180.0
    seed: int = 0
    block_size: int | None = None  # None: read from P's /metrics, else vLLM's default
    tokenize_url: str | None = None

    def __post_init__(self) -> None:
        if len(set(self.lengths)) < MIN_LENGTHS:
            raise CalibrationError(
                f"give at least {MIN_LENGTHS} different --lengths (got "
                f"{', '.join(map(str, self.lengths)) or 'none'}): the fit needs them"
            )
        if min(self.lengths) <= 0:
            raise CalibrationError("every --lengths value must be > 0")
        if self.conversations < 1:
            raise CalibrationError("--conversations must be >= 1")
        if self.budget_s <= 0:
            raise CalibrationError("--budget must be > 0 seconds")
        if not any(name.startswith("prefill") for name in self.nodes):
            raise CalibrationError(
                "the fit needs P's /metrics (KV transfers, tokens by source): give "
                "--metrics-url prefill=URL"
            )


@dataclass
class LiveResult:
    out: Path
    elapsed_s: float
    conversations: dict[int, int] = field(default_factory=dict)  # per length, as run
    cost: CostModel | None = None


class _Budget:
    """The time left and what the phases so far say the rest will take."""

    def __init__(self, seconds: float) -> None:
        self.t0 = time.monotonic()
        self.seconds = seconds
        self.records: list[RequestRecord] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def per_request_s(self, prompt_tokens: float) -> float:
        """A line through the latencies so far (s) against prompt tokens; 0 before any."""
        ok = [r for r in self.records if r.ok]
        if not ok:
            return 0.0
        xs = [float(r.input_num_tokens) for r in ok]
        ys = [r.latency_ms / 1e3 for r in ok]
        fixed, slope = linear_fit(xs, ys)
        return max(fixed + slope * prompt_tokens, max(ys) if len(set(xs)) == 1 else 0.0)

    def phases_s(self, lengths: Sequence[int], n: int, *, spec: WorkloadSpec) -> float:
        """Estimated seconds for OFF and ON of ``lengths`` with ``n`` conversations each."""
        total = 0.0
        for length in lengths:
            first = length + spec.input_tokens
            second = first + spec.output_tokens + spec.input_tokens
            total += n * (self.per_request_s(first) + self.per_request_s(second))
        return total


def conversations_that_fit(estimate: Callable[[int], float], left_s: float, n: int) -> int | None:
    """The most conversations per length, at most ``n``, whose estimated phases fit the
    time left; ``None`` when not even one does. An estimate of 0 (nothing measured yet)
    always fits."""
    for k in range(n, 0, -1):
        if estimate(k) <= left_s:
            return k
    return None


def _block_size(nodes: Mapping[str, str], given: int | None) -> tuple[int, str]:
    """The deployment's KV block size: given, else P's ``vllm:cache_config_info``."""
    if given:
        return given, "--block-size"
    snaps = snapshot_nodes({k: v for k, v in nodes.items() if k.startswith("prefill")})
    for snap in snaps.values():
        if snap is None:
            continue
        for (name, labels), _ in snap.samples.items():
            if name == "vllm:cache_config_info":
                value = dict(labels).get("block_size")
                if value and value.isdigit():
                    return int(value), "P's vllm:cache_config_info"
    return DEFAULT_BLOCK_SIZE, "vLLM's default (P exports no vllm:cache_config_info)"


def _counter(opts: LiveOptions) -> TokenCounter:
    url = opts.tokenize_url or opts.nodes.get("prefill0") or opts.url
    counter = HttpTokenCounter(url, opts.model)
    if counter.available():
        return counter
    print(
        f"{PROG}: warning: no /tokenize at {url}; prompt lengths are counted in words",
        file=sys.stderr,
    )
    return count_words


def measure(opts: LiveOptions, out: Path, *, verbose: bool = True) -> LiveResult:
    """Measure OFF and ON at every length into ``out`` (a bench result directory)."""
    budget = _Budget(opts.budget_s)
    out.mkdir(parents=True, exist_ok=True)
    block, block_from = _block_size(opts.nodes, opts.block_size)
    counter = _counter(opts)
    specs = {
        length: WorkloadSpec(
            prefix_tokens=length,
            num_conversations=opts.conversations,
            num_turns=2,
            input_tokens=opts.input_tokens,
            output_tokens=opts.output_tokens,
            seed=opts.seed,
        )
        for length in sorted(set(opts.lengths))
    }
    manifest: dict[str, Any] = {
        "tool": PROG,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv[1:],
        "topology": "external",
        "profile": None,
        "model": opts.model,
        "legs": list(LEGS),
        "connector": None,
        "points": list(specs),
        "workload": {
            "num_turns": 2,
            "input_tokens": opts.input_tokens,
            "output_tokens": opts.output_tokens,
            "off": "turn 1 of each conversation (D holds nothing: P computes it all)",
            "on": "turn 2 (D holds turn 1's prompt and answer: P pulls it)",
        },
        "num_clients": 1,
        "max_active_conversations": 1,
        "engines": {"block_size": block, "block_size_from": block_from},
        "budget_s": opts.budget_s,
        "complete": False,
        "runs": {},
    }
    write_manifest(out, manifest)
    result = LiveResult(out, 0.0)
    intr = Interrupt()
    intr.install()
    lengths = list(specs)
    n = opts.conversations
    for i, length in enumerate(lengths):
        spec = specs[length]
        rest = lengths[i:]
        # the phases still to come must fit the time left: fewer conversations, or stop
        fits = conversations_that_fit(partial(budget.phases_s, rest, spec=spec), budget.left(), n)
        if fits is None:
            raise CalibrationError(
                f"the budget of {opts.budget_s:g} s runs out before length {length} "
                f"({budget.elapsed():.0f} s used; one conversation per remaining length "
                f"would take ~{budget.phases_s(rest, 1, spec=spec):.0f} s more): give shorter "
                "--lengths or a larger --budget"
            )
        n = fits
        convs = build_conversations(replace(spec, num_conversations=n), counter)
        result.conversations[length] = n
        states: dict[str, ConversationState] = {}
        for turn, leg in enumerate(LEGS, start=1):
            if not _phase(opts, out, manifest, budget, intr, convs, states, leg, length, turn):
                raise CalibrationError("interrupted: the calibration is incomplete")
            if verbose:
                done = manifest["runs"][leg][str(length)]
                print(
                    f"{PROG}: {leg.upper()} {length:>6}: {done['requests']} request(s) in "
                    f"{done['duration_s']:.1f} s ({budget.elapsed():.0f} of "
                    f"{opts.budget_s:g} s used)",
                    file=sys.stderr,
                    flush=True,
                )
    result.elapsed_s = budget.elapsed()
    manifest["complete"] = True
    manifest["elapsed_s"] = round(result.elapsed_s, 3)
    write_manifest(out, manifest)
    return result


def _phase(
    opts: LiveOptions,
    out: Path,
    manifest: dict[str, Any],
    budget: _Budget,
    intr: Interrupt,
    convs: Sequence[Conversation],
    states: dict[str, ConversationState],
    leg: str,
    length: int,
    turn: int,
) -> bool:
    """One turn of every conversation, scraped before and after; False when interrupted."""
    run = RunOptions(
        url=opts.url,
        model=opts.model,
        num_clients=1,
        max_active_conversations=1,
        request_timeout_s=max(1.0, budget.left()),
    )
    before = snapshot_nodes(opts.nodes)
    res = run_point_interruptible(
        convs, run, leg, lambda rec: None, intr, upto_turn=turn, states=states
    )
    after = snapshot_nodes(opts.nodes)
    write_point(out, leg, length, res, metrics_delta(before, after))
    budget.records += res.records
    manifest["runs"].setdefault(leg, {})[str(length)] = {
        "duration_s": round(res.duration_s, 3),
        "requests": len(res.records),
        "errors": res.errors,
        "interrupted": res.interrupted,
    }
    write_manifest(out, manifest)
    if budget.left() <= 0:  # requests time out when the budget ends: say so first
        raise CalibrationError(
            f"the budget of {opts.budget_s:g} s ran out during {leg.upper()} at length "
            f"{length}: give shorter --lengths or a larger --budget"
        )
    if res.errors:
        first = next(r for r in res.records if not r.ok)
        raise CalibrationError(
            f"{leg.upper()} at length {length}: {res.errors} request(s) failed (first: "
            f"{first.error}); the calibration needs every request to succeed"
        )
    return not res.interrupted


def _why_no_pulls(out: Path) -> str | None:
    """When the ON phases pulled nothing, why (P's own prefix cache served the history)."""
    rows = [r for r in summarize_result(load_result(out), min_turn=1).rows if r.leg == "on"]
    if any(r.tokens_external for r in rows):
        return None
    hit = sum(r.tokens_local_cache_hit for r in rows)
    if hit:
        return (
            f"P served the history from its own prefix cache ({hit:,.0f} tokens hit, none "
            "pulled): run P with --no-enable-prefix-caching (the publication's setup) so a "
            "second turn reads D's blocks"
        )
    return (
        "no second turn pulled D's blocks (P's tokens by source show no external KV): is "
        "bidirectional_kv_xfer on, and do the conversation ids reach the router?"
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="Measure a running P/D pair (OFF and ON at three lengths, within a time "
        "budget), fit the planner's terms and write them as a profile.",
    )
    ap.add_argument("-u", "--url", required=True, help="the router in front of the P/D pair")
    ap.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        metavar="ROLE=URL",
        help="a node to scrape: prefill=URL (required), decode=URL, router=URL (default: --url)",
    )
    ap.add_argument("--tokenize-url", help="a node with /tokenize (default: P's)")
    ap.add_argument("-m", "--model", default=LiveOptions.model, help="served model name")
    ap.add_argument(
        "--lengths",
        type=int_list,
        default=list(LiveOptions.lengths),
        help="prompt lengths (prefix tokens of turn 1), at least three (default 256,1024,2048)",
    )
    ap.add_argument(
        "--conversations",
        type=int,
        default=LiveOptions.conversations,
        help="conversations per length (fewer are run when the budget needs it)",
    )
    ap.add_argument("--input-tokens", type=int, default=LiveOptions.input_tokens)
    ap.add_argument("--output-tokens", type=int, default=LiveOptions.output_tokens)
    ap.add_argument(
        "--budget",
        type=float,
        default=LiveOptions.budget_s,
        help="seconds the whole measurement may take (default 180)",
    )
    ap.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="the deployment's KV block size (default: P's vllm:cache_config_info, else 16)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "-o",
        "--out",
        type=Path,
        default=None,
        help="result directory (default out/calibrate-<time>)",
    )
    ap.add_argument(
        "--write-profile",
        type=Path,
        metavar="FILE",
        help="write the calibration as a profile (default: DIR/profile.json)",
    )
    ap.add_argument("--json", action="store_true", help="print the fitted terms as JSON")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out: Path = args.out or Path("out") / time.strftime("calibrate-%Y%m%d-%H%M%S")
    try:
        nodes = dict(parse_metrics_urls(args.metrics_url, PROG))
        nodes.setdefault("router0", args.url)
        opts = LiveOptions(
            url=args.url,
            nodes=nodes,
            model=args.model,
            lengths=tuple(args.lengths),
            conversations=args.conversations,
            input_tokens=args.input_tokens,
            output_tokens=args.output_tokens,
            budget_s=args.budget,
            seed=args.seed,
            block_size=args.block_size,
            tokenize_url=args.tokenize_url,
        )
        live = measure(opts, out)
        why = _why_no_pulls(out)
        if why:
            raise CalibrationError(why)
        result = load_result(out)
        cost = calibrate(result)
        path = args.write_profile or out / "profile.json"
        data = calibrated_profile(result, cost, path.stem)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    except (PlanError, ResultError, ProfileError, WorkloadError, ClientError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; partial result in {out}", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps({"profile": str(path), "elapsed_s": live.elapsed_s, **cost.to_dict()}))
        return 0
    print(_report(live, cost, path, check_rows(result, cost)))
    return 0


def _report(live: LiveResult, cost: CostModel, profile: Path, rows: Sequence[Any]) -> str:
    lines = [
        f"measured in {live.elapsed_s:.0f} s: "
        + ", ".join(f"{n} conversation(s) at {length}" for length, n in live.conversations.items()),
        f"  recompute {cost.recompute_us_per_token:.3f} µs/token + "
        f"{cost.prefill_fixed_us / 1e3:.2f} ms per request",
        f"  pull {cost.pull_overhead_us / 1e3:.2f} ms + {cost.pull_us_per_token:.3f} µs/token "
        f"(transfer {cost.xfer_us_per_token:.3f}, P's work {cost.pull_after_us_per_token:.3f})",
        f"  D's part of TTFT {cost.decode_ttft_fixed_us / 1e3:.2f} ms + "
        f"{cost.decode_ttft_us_per_token:.3f} µs per prompt token",
        *(f"  - {n}" for n in cost.notes),
        "  router prefill per request, measured / fitted (ms):",
        *(
            f"    {r.point:>6}  OFF {r.off_ms or 0:8.1f} / {r.off_pred_ms or 0:8.1f}   "
            f"ON {r.on_ms or 0:8.1f} / {r.on_pred_ms or 0:8.1f}"
            for r in rows
        ),
        f"profile: {profile} (bidir-kv plan --profile {profile}; bench/engine --profile too)",
        f"result: {live.out} (bidir-kv plan --calibration {live.out})",
    ]
    return "\n".join(lines)
