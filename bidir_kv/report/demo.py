"""``bidir-kv demo`` (``make demo``): the AWS blog's OFF/ON sweep on this machine, in real time.

Starts an emulated 1P1D + router with a realistic profile (default
``qwen3-32b-p5en``), runs the OFF leg and the ON leg with the publication's
workload shape (P's prefix cache off, 150 input and 300 output tokens per turn, 2
clients, prefix lengths 2k to 24k), renders the report and the two plots, and
prints per length the measured TTFT, prefill and KV transfer beside the planner's
prediction. Every process is started through ``bidir_kv.topology`` and stopped
when its leg ends (also on Ctrl-C or errors).

Durations are the target's, in absolute milliseconds (``--time-scale 1``), so they
can stand next to a published chart; ``--time-scale`` > 1 stretches them (ratios
kept) when this machine's own per-request overhead is too large against them. The
run measures that overhead and the machine's load and says when they make the
headline unreliable (``bidir_kv.report.headline``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bidir_kv.bench import cli as bench_cli
from bidir_kv.bench.results import LegPoint, load_result
from bidir_kv.bench.split import on_prefill_split
from bidir_kv.bench.summary import Summary, ratio_rows, summarize_result
from bidir_kv.engine.profiles import PROFILE_DIR, ProfileError, load_profile
from bidir_kv.plan.predict import Prediction, predict
from bidir_kv.plan.published import FIGURES, PublishedTable, load_table
from bidir_kv.report.cli import decode_table, render_dir
from bidir_kv.report.headline import headline, headline_text

__all__ = [
    "main",
    "measured_figures",
    "published_lines",
    "rewritten_leg",
    "rewritten_table",
    "scaled_profile",
]

# the publication's acceptance band for a figure of the demo against the published one
PUBLISHED_BAND = 0.15
_LABELS = {
    "ttft_off": "TTFT OFF",
    "ttft_on": "TTFT ON",
    "prefill_off": "prefill OFF",
    "prefill_on": "prefill ON",
    "kv_transfer": "KV transfer",
}


def scaled_profile(name: str, scale: float, out_dir: Path) -> Path:
    """Write ``name`` with ``time_scale`` multiplied by ``scale``; returns the JSON path."""
    prof = load_profile(name)
    scaled = replace(prof, name=f"{prof.name}-x{scale:g}", time_scale=prof.time_scale * scale)
    data = scaled.to_dict()
    data["derivation"] = (
        f"{prof.name} (bidir_kv/data/profiles, derivation in docs/profiles.md) with every emulated "
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
        default=1.0,
        help="multiply emulated durations (default 1: the target's real time, absolute ms)",
    )
    # three of the publication's seven lengths and half its conversations: 40 measured turns
    # per length and leg in < 5 min on 2 cores (docs/benchmarking.md "demo")
    ap.add_argument("--prefix-tokens", default="2000,12000,24000")
    ap.add_argument("--num-conversations", type=int, default=5)
    ap.add_argument("--num-turns", type=int, default=10)
    ap.add_argument(
        "--warmup-fraction",
        type=float,
        default=0.2,
        help="leading fraction of each conversation's turns left out of the figures "
        "(default 0.2, the publication's warm-up)",
    )
    ap.add_argument("--input-tokens", type=int, default=150)
    ap.add_argument("--output-tokens", type=int, default=300)
    ap.add_argument("--num-clients", type=int, default=2)
    ap.add_argument(
        "--transport",
        choices=("auto", "nixl", "tcp"),
        default="tcp",
        help="emulator KV transport (default tcp: UCX progress threads compete for "
        "the 2 cores of a small machine)",
    )
    ap.add_argument(
        "--kv-verify",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the engines' pulled-KV check (a test oracle costing about one prefill's CPU "
        "per pulled token; off in the demo so P's own CPU stays small against its "
        "emulated prefill)",
    )
    ap.add_argument(
        "--rewritten",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the sweep, a short ON leg where clients rewrite the previous reply "
        "(replaced, cut to half, reasoning stripped; with and without ids) and the tokens "
        "reused are set against the tokens reusable (docs/benchmarking.md; ~20 s)",
    )
    ap.add_argument("-o", "--out", type=Path, default=Path("out/demo"))
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.time_scale <= 0:
        ap.error("--time-scale must be > 0")
    if not 0 <= args.warmup_fraction < 1:
        ap.error("--warmup-fraction must be in [0, 1)")
    t0 = time.monotonic()
    if args.out.exists():
        shutil.rmtree(args.out)
    try:
        profile_path = (
            scaled_profile(args.profile, args.time_scale, args.out)
            if args.time_scale != 1
            else Path(args.profile)
        )
        load_profile(str(profile_path))
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
    _print_outcome(
        args.out,
        args.profile,
        min_turn(args.num_turns, args.warmup_fraction),
        args.time_scale,
    )
    if args.rewritten:
        rc = rewritten_leg(args.out / "rewritten", args.transport)
        if rc != 0:
            return rc
    print(f"done in {time.monotonic() - t0:.0f} s; every process stopped")
    return 0


# the rewritten-history leg: reuse is a count of tokens, not a time, so the tiny
# profile (no emulated durations) serves it in seconds; every run shares one topology
REWRITTEN = ("verbatim", "replaced", "half", "no-think")
_REWRITTEN_WORKLOAD = (
    "--prefix-tokens",
    "2000",
    "--num-conversations",
    "2",
    "--num-turns",
    "3",
    "--input-tokens",
    "150",
    "--output-tokens",
    "300",
)


def rewritten_leg(out: Path, transport: str) -> int:
    """ON only, on one emulated 1P1D + router (tiny profile): each history mode with and
    without conversation ids, a ``bench --url`` run each (its own seed, so no run
    finds another's conversations); prints tokens reused / tokens reusable per run."""
    from bidir_kv.bench.topo import LegSetup, node_urls, start_leg

    print(
        "\nrewritten history (ON; tiny profile, 2 conversations x 3 turns, 2000-token "
        "prefix): tokens P read from D / tokens D's retained turns could serve",
        flush=True,
    )
    setup = LegSetup(profile="tiny", transport=transport, log_dir=out / "logs")
    rows: list[tuple[str, str, LegPoint | None]] = []
    with start_leg("on", setup) as topo:
        metrics = [f"{name[:-1]}={url}" for name, url in node_urls(topo).items()]
        for seed, (history, ids) in enumerate(
            (h, i)
            for h in REWRITTEN
            for i in ("--send-conversation-id", "--no-send-conversation-id")
        ):
            run = out / f"{history}{'' if ids.startswith('--send') else '-no-id'}"
            argv = [
                "--url",
                topo.router_url,
                *(a for m in metrics for a in ("--metrics-url", m)),
                "--legs",
                "on",
                "--model",
                setup.model,
                "--block-size",
                str(setup.block_size),
                *_REWRITTEN_WORKLOAD,
                "--history",
                history,
                ids,
                "--seed",
                str(1000 + seed),
                "--no-progress",
                "--no-client-check",
                "-o",
                str(run),
            ]
            said = io.StringIO()  # the table below says it; shown when a run fails
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                rc = bench_cli.main(argv)
            if rc != 0:
                print(said.getvalue(), end="")
                print(f"bidir-kv demo: the rewritten-history run {run.name} failed (exit {rc})")
                return rc
            summary = summarize_result(load_result(run))
            rows.append(
                (history, "yes" if ids.startswith("--send") else "no", summary.get("on", 2000))
            )
    for line in rewritten_table(rows):
        print(line)
    return 0


def rewritten_table(rows: Sequence[tuple[str, str, LegPoint | None]]) -> list[str]:
    """History mode, ids, and tokens reused / reusable (share) per run."""
    lines = [f"{'history':<9} {'ids':<4} {'reused':>8} {'reusable':>9} {'share':>6}"]
    for history, ids, row in rows:
        if row is None:
            lines.append(f"{history:<9} {ids:<4} {'n/a':>8} {'n/a':>9} {'n/a':>6}")
            continue
        share = row.reused_share
        lines.append(
            f"{history:<9} {ids:<4} {row.tokens_external:>8.0f} "
            f"{_f(row.tokens_reusable, '9.0f')} "
            f"{'n/a' if share is None else format(100 * share, '5.0f') + '%':>6}"
        )
    return lines


def _sweep_argv(args: argparse.Namespace, profile_path: Path) -> list[str]:
    """The ``bidir-kv bench`` arguments of the demo's sweep."""
    return [
        "--topology",
        "emulator",
        "--profile",
        str(profile_path),
        "--prefix-tokens",
        args.prefix_tokens,
        "--num-conversations",
        str(args.num_conversations),
        "--num-turns",
        str(args.num_turns),
        "--input-tokens",
        str(args.input_tokens),
        "--output-tokens",
        str(args.output_tokens),
        "--num-clients",
        str(args.num_clients),
        "--max-active-conversations",
        str(args.num_conversations),
        "--transport",
        args.transport,
        "-o",
        str(args.out),
        *([] if args.kv_verify else ["--engine-arg=--no-kv-verify"]),
    ]


def min_turn(num_turns: int, warmup_fraction: float) -> int:
    """First measured 1-based turn: after the warm-up, and never turn 1 (a miss in both
    legs)."""
    return max(2, 1 + math.ceil(warmup_fraction * num_turns))


def _print_outcome(out: Path, profile: str, first_turn: int = 2, time_scale: float = 1.0) -> None:
    """Render the report; print per length the measurements beside the planner's
    prediction (and the published figures, if any), the headline with its
    reliability, and where the files are."""
    report, _ = render_dir(out)
    summary = summarize_result(load_result(out), min_turn=first_turn)
    pred = predict(summary)
    print()
    print(f"profile {profile}: {_profile_sources(profile)}")
    if isinstance(pred, str):
        print(f"planner: no prediction ({pred})")
    else:
        print(f"planner: {pred.source}; break-even {pred.break_even_tokens:.0f} history tokens")
    print(
        f"turns >= {summary.min_turn} (turn 1 is a miss in both legs; earlier turns are "
        "warm-up); times in ms"
    )
    for line in length_table(summary, pred):
        print(line)
    print()
    print(
        "decode side (ms; TPOT = (latency - TTFT) / (output tokens - 1) per request, ITL = "
        "gaps between streamed chunks; D's retained share sampled from its /metrics):"
    )
    print(decode_table(summary))
    table = load_table(profile)
    if table is not None and time_scale != 1:
        print(
            f"published figures of {table.name} not compared: --time-scale {time_scale:g} "
            "stretches every duration"
        )
    elif table is not None:
        measured = {p: measured_figures(summary, p) for p in summary.result.prefix_points}
        print()
        for line in published_lines(table, measured):
            print(line)
    print(headline_text(headline(summary)))
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
    print(f"plots:  {out / 'ttft.png'}  {out / 'prefill.png'}  {out / 'decode.png'}")


def _profile_sources(profile: str) -> str:
    """What the profile file says it was derived from (its sources, else derivation)."""
    path = Path(profile) if Path(profile).suffix else PROFILE_DIR / f"{profile}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return "(profile file not readable)"
    src = data.get("sources") or data.get("derivation") or "(no sources recorded)"
    if isinstance(src, list | dict):
        src = json.dumps(src)
    return str(src)[:600]


def length_table(summary: Summary, pred: Prediction | str) -> list[str]:
    """Per prompt length: OFF/ON TTFT, prefill, KV transfer, and the prediction."""
    predicted = {} if isinstance(pred, str) else {p.point: p for p in pred.points}
    head = (
        f"{'prefix':>7} {'TTFT OFF':>9} {'TTFT ON':>8} {'OFF/ON':>7} {'prefill OFF':>11} "
        f"{'prefill ON':>10} {'xfer ms':>8} {'MiB/xfer':>9} {'pred OFF/ON':>11} "
        f"{'meas OFF/ON':>11}"
    )
    lines = [head]
    for row in ratio_rows(summary):
        point = int(row["point"])
        off, on = summary.get("off", point), summary.get("on", point)
        split = on_prefill_split(summary, point)
        on_prefill = split[0] if split else (on.prefill_ms if on else None)
        off_prefill = off.prefill_ms if off else None
        meas = off_prefill / on_prefill if off_prefill and on_prefill else None
        p = predicted.get(point)
        lines.append(
            f"{point:>7} {_f(row['ttft_off_ms'], '9.0f')} {_f(row['ttft_on_ms'], '8.0f')} "
            f"{_f(row['ttft_ratio'], '6.2f')}× {_f(off_prefill, '11.0f')} "
            f"{_f(on_prefill, '10.0f')} {_f(split[1] if split else None, '8.1f')} "
            f"{_f(on.mb_per_transfer if on else None, '9.1f')} "
            f"{_f(p.predicted_ratio if p else None, '10.2f')}× {_f(meas, '10.2f')}×"
        )
    return lines


def _f(v: float | None, spec: str) -> str:
    width = int(spec.split(".")[0] or 0)
    return "n/a".rjust(width) if v is None else format(v, spec)


def measured_figures(summary: Summary, point: int) -> dict[str, float | None]:
    """The run's figures at ``point`` named as a published table names them (ms):
    TTFT medians, mean router prefill (ON: reuse turns), mean rank-level transfer."""
    off, on = summary.get("off", point), summary.get("on", point)
    split = on_prefill_split(summary, point)
    return {
        "ttft_off": off.ttft_median if off else None,
        "ttft_on": on.ttft_median if on else None,
        "prefill_off": off.prefill_ms if off else None,
        "prefill_on": split[0] if split else (on.prefill_ms if on else None),
        "kv_transfer": on.xfer_ms_per_transfer if on else None,
    }


def published_lines(
    table: PublishedTable, measured: dict[int, dict[str, float | None]]
) -> list[str]:
    """Per length the table gives and the run measured: published, measured, difference,
    and whether the difference is inside the acceptance band (±15 %)."""
    lines = [
        f"published beside measured, ms ({table.name}: {table.source.split(':')[0]}); "
        f"band ±{PUBLISHED_BAND:.0%}",
        f"{'prefix':>7}  {'figure':<12} {'published':>9} {'measured':>9} {'diff':>7}",
    ]
    shown = 0
    for point in sorted(table.figures_ms):
        mine = measured.get(point)
        if mine is None:
            continue
        for name in FIGURES:
            pub = table.figure(point, name)
            if pub is None:
                continue
            got = mine.get(name)
            if got is None or math.isnan(got):
                lines.append(f"{point:>7}  {_LABELS[name]:<12} {pub:>9.0f} {'n/a':>9}")
                continue
            diff = (got - pub) / pub
            mark = "" if abs(diff) <= PUBLISHED_BAND else "  outside the band"
            lines.append(
                f"{point:>7}  {_LABELS[name]:<12} {pub:>9.0f} {got:>9.1f} {diff:>+7.1%}{mark}"
            )
            shown += 1
    if not shown:
        lines.append(
            f"  (none of the run's lengths is in the table: it gives "
            f"{', '.join(str(p) for p in sorted(table.figures_ms))})"
        )
    return lines
