"""``bidir-kv calibrate``: measure a running P/D pair in minutes and write its cost profile.

The planner's terms of a deployment you run, without a sweep of its own
(docs/profiles.md §6): three prompt lengths, each measured OFF and ON through the
router in front of the pair, then fitted by the same fit as the published table
(:func:`bidir_kv.plan.calibrate.fit`) and written as a profile that ``plan``,
``bench`` and ``engine`` load.

How OFF and ON are measured on a deployment that runs with the feature on: every
length gets new conversations. Their first turns are the OFF point: D holds nothing
of them yet, so P computes the whole prompt (what OFF does to every turn). Their
second turns are the ON point: D holds the first turn's prompt and answer, P pulls it
and computes the new message. Every node is scraped between requests and the deltas
are summed per (leg, length), so each point's transfer histogram, tokens by source
and router prefill histogram are its own. One client, one request at a time: no
request waits for another's compute, so the fit needs no contention term. The
lengths are interleaved — each round opens one conversation per length and runs
OFF at every length, then ON — so a load burst on a shared machine lands on every
length alike instead of bending the fitted line. The directory it writes is a
``bench`` result (``plan --calibration DIR`` reads it again).

The run is bounded: ``--budget`` seconds for the whole command (default 180). Rounds
repeat, up to ``--conversations``, while the slowest round so far still fits the
time left; a request still running when the budget ends fails the command with a
message naming the budget and the length.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bidir_kv.bench.args import int_list
from bidir_kv.bench.interrupt import Interrupt, run_point_interruptible
from bidir_kv.bench.results import ResultError, load_result
from bidir_kv.bench.runner import (
    ConversationState,
    HttpTokenCounter,
    PointResult,
    RunOptions,
    metrics_delta,
    snapshot_nodes,
    write_point,
)
from bidir_kv.bench.stats import RequestRecord
from bidir_kv.bench.summary import summarize_result
from bidir_kv.bench.sweep import parse_metrics_urls, write_manifest
from bidir_kv.bench.workload import (
    TokenCounter,
    WorkloadError,
    WorkloadSpec,
    build_conversations,
    count_words,
)
from bidir_kv.client import ClientError, NodeClient
from bidir_kv.engine.profiles import ProfileError
from bidir_kv.plan.calibrate import calibrate, check_rows
from bidir_kv.plan.calprofile import calibrated_profile
from bidir_kv.plan.planner import DEFAULT_BLOCK_SIZE, CostModel, PlanError

__all__ = [
    "CalibrationError",
    "LiveOptions",
    "LiveResult",
    "another_round_fits",
    "build_parser",
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
    conversations: int = 8
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
    """The time used and left, and the requests measured so far."""

    def __init__(self, seconds: float) -> None:
        self.t0 = time.monotonic()
        self.seconds = seconds
        self.records: list[RequestRecord] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()


def another_round_fits(rounds_done: int, slowest_round_s: float, left_s: float) -> bool:
    """Whether to start another round: the first always runs; then only when the slowest
    round so far still fits the time left."""
    return rounds_done == 0 or slowest_round_s <= left_s


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


def _served_model(nodes: Mapping[str, str]) -> str:
    """The model P serves (the first of its ``/v1/models``), for a run without ``-m``."""
    url = next((u for k, u in nodes.items() if k.startswith("prefill")), None)
    if url is None:
        return LiveOptions.model  # LiveOptions names the missing node
    try:
        data = NodeClient(url, timeout=10.0).get_json("/v1/models")
        return str(data["data"][0]["id"])
    except (ClientError, KeyError, IndexError, TypeError) as exc:
        raise CalibrationError(
            f"cannot read the served model from {url}/v1/models ({exc}): give -m NAME"
        ) from None


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
    """Measure OFF and ON at every length into ``out`` (a bench result directory).

    The lengths are interleaved: each round opens one conversation per length, runs
    their first turns (OFF) and then their second turns (ON), one request at a time,
    with every node scraped between requests. A load burst on a shared machine then
    lands on every length alike instead of bending the fitted line; rounds repeat up to
    ``conversations`` while the next one fits the time left.
    """
    budget = _Budget(opts.budget_s)
    out.mkdir(parents=True, exist_ok=True)
    block, block_from = _block_size(opts.nodes, opts.block_size)
    counter = _counter(opts)
    lengths = sorted(set(opts.lengths))
    convs = {
        length: build_conversations(
            WorkloadSpec(
                prefix_tokens=length,
                num_conversations=opts.conversations,
                num_turns=2,
                input_tokens=opts.input_tokens,
                output_tokens=opts.output_tokens,
                seed=opts.seed,
            ),
            counter,
        )
        for length in lengths
    }
    manifest = _manifest(opts, lengths, block, block_from)
    write_manifest(out, manifest)
    result = LiveResult(out, 0.0)
    intr = Interrupt()
    intr.install()
    points = {(leg, length): _Point() for leg in LEGS for length in lengths}
    states: dict[str, ConversationState] = {}
    snap = snapshot_nodes(opts.nodes)
    t0 = time.perf_counter()
    slowest_round = 0.0
    rounds = 0
    for r in range(opts.conversations):
        if not another_round_fits(rounds, slowest_round, budget.left()):
            break  # another round would not fit: fit what ran
        started = budget.elapsed()
        for turn, leg in enumerate(LEGS, start=1):
            for length in lengths:
                run = RunOptions(
                    url=opts.url,
                    model=opts.model,
                    num_clients=1,
                    max_active_conversations=1,
                    request_timeout_s=max(1.0, budget.left()),
                )
                offset_ms = (time.perf_counter() - t0) * 1e3
                res = run_point_interruptible(
                    [convs[length][r]], run, leg, _ignore, intr, upto_turn=turn, states=states
                )
                after = snapshot_nodes(opts.nodes)
                points[(leg, length)].add(res, metrics_delta(snap, after), offset_ms)
                snap = after
                budget.records += res.records
                _check(opts, budget, res, leg, length)
                if res.interrupted:
                    raise CalibrationError("interrupted: the calibration is incomplete")
        rounds += 1
        slowest_round = max(slowest_round, budget.elapsed() - started)
        if verbose:
            print(
                f"{PROG}: round {rounds}: OFF and ON at {', '.join(map(str, lengths))} in "
                f"{budget.elapsed() - started:.1f} s ({budget.elapsed():.0f} of "
                f"{opts.budget_s:g} s used)",
                file=sys.stderr,
                flush=True,
            )
    for (leg, length), point in points.items():
        res = PointResult(point.records, point.duration_s)
        write_point(out, leg, length, res, point.delta)
        manifest["runs"].setdefault(leg, {})[str(length)] = {
            "duration_s": round(point.duration_s, 3),
            "requests": len(point.records),
            "errors": res.errors,
            "interrupted": False,
        }
    result.conversations = dict.fromkeys(lengths, rounds)
    result.elapsed_s = budget.elapsed()
    manifest["complete"] = True
    manifest["rounds"] = rounds
    manifest["elapsed_s"] = round(result.elapsed_s, 3)
    write_manifest(out, manifest)
    return result


def _ignore(rec: RequestRecord) -> None:
    """No progress display: the command prints one line per round."""


@dataclass
class _Point:
    """One (leg, length) point summed over the rounds: records, metric deltas, time."""

    records: list[RequestRecord] = field(default_factory=list)
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float] | None] = field(
        default_factory=dict
    )
    duration_s: float = 0.0

    def add(self, res: PointResult, delta: Mapping[str, Any], offset_ms: float) -> None:
        # one timeline for the point's arrivals (the contention replay reads start times)
        self.records += [replace(r, start_time_ms=r.start_time_ms + offset_ms) for r in res.records]
        self.duration_s += res.duration_s
        for node, rows in delta.items():
            if rows is None:
                self.sums[node] = None
                continue
            if node in self.sums and self.sums[node] is None:
                continue
            acc = self.sums.setdefault(node, {})
            assert acc is not None
            for name, labels, value in rows:
                key = (str(name), tuple(sorted(dict(labels).items())))
                acc[key] = acc.get(key, 0.0) + float(value)

    @property
    def delta(self) -> dict[str, Any]:
        """The summed deltas in ``metrics_delta``'s shape."""
        return {
            node: None
            if acc is None
            else [[n, dict(labels), v] for (n, labels), v in sorted(acc.items()) if v != 0]
            for node, acc in self.sums.items()
        }


def _check(opts: LiveOptions, budget: _Budget, res: PointResult, leg: str, length: int) -> None:
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


def _manifest(
    opts: LiveOptions, lengths: Sequence[int], block: int, block_from: str
) -> dict[str, Any]:
    return {
        "tool": PROG,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv[1:],
        "topology": "external",
        "profile": None,
        "model": opts.model,
        "legs": list(LEGS),
        "connector": None,
        "points": list(lengths),
        "workload": {
            "num_turns": 2,
            "input_tokens": opts.input_tokens,
            "output_tokens": opts.output_tokens,
            "off": "turn 1 of each conversation (D holds nothing: P computes it all)",
            "on": "turn 2 (D holds turn 1's prompt and answer: P pulls it)",
            "order": "rounds: one conversation per length, OFF at every length then ON",
        },
        "num_clients": 1,
        "max_active_conversations": 1,
        "engines": {"block_size": block, "block_size_from": block_from},
        "budget_s": opts.budget_s,
        "complete": False,
        "runs": {},
    }


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
    ap.add_argument(
        "-m", "--model", default=None, help="served model name (default: P's /v1/models)"
    )
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
        help="rounds, at most: each opens one conversation per length (default 8; fewer "
        "when the next round would not fit the budget)",
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
            model=args.model or _served_model(nodes),
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
