"""``bidir-kv report DIR...``: Markdown summary, TTFT and prefill plots, ratio table."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from bidir_kv.bench.compare import connector_table
from bidir_kv.bench.concurrency import CONCURRENCY_FILE, level_dir
from bidir_kv.bench.results import ResultError, load_result
from bidir_kv.bench.summary import (
    Summary,
    concurrency_rows,
    decode_rows,
    load_levels,
    ratio_rows,
    summarize_result,
)
from bidir_kv.plan.predict import predict
from bidir_kv.report.markdown import render_concurrency, render_markdown
from bidir_kv.report.plots import write_concurrency_plot, write_plots

__all__ = ["decode_table", "main", "ratio_table", "render_concurrency_dir", "render_dir"]


def render_dir(
    path: Path, out: Path | None = None, min_turn: int = 2, plots: bool = True
) -> tuple[Path, str]:
    """Render one result directory; returns (report path, ratio table text). Without
    ``plots`` the report has its tables only (no PNG is written, none is linked)."""
    summary = summarize_result(load_result(path), min_turn=min_turn)
    out_dir = out or path
    out_dir.mkdir(parents=True, exist_ok=True)
    written = write_plots(summary, out_dir) if plots else []
    md = render_markdown(summary, predict(summary), [str(p) for p in written])
    report_path = out_dir / "report.md"
    report_path.write_text(md)
    table = f"{ratio_table(summary)}\n\n{decode_table(summary)}"
    connectors = connector_table(summary)
    return report_path, f"{table}\n\n{connectors}" if connectors else table


def ratio_table(summary: Summary) -> str:
    """Plain-text OFF/ON TTFT table for the console."""
    lines = [f"{'prefix':>8} {'OFF ms':>9} {'ON ms':>9} {'OFF/ON':>7}"]
    for row in ratio_rows(summary):

        def f(v: object, spec: str) -> str:
            return "n/a" if v is None else format(v, spec)

        lines.append(
            f"{row['point']:>8} {f(row['ttft_off_ms'], '9.0f'):>9} "
            f"{f(row['ttft_on_ms'], '9.0f'):>9} {f(row['ttft_ratio'], '6.2f'):>6}×"
        )
    return "\n".join(lines)


def decode_table(summary: Summary) -> str:
    """Plain-text decode side, OFF/ON per point: TTFT beside TPOT p50/p99 (ms), ITL p99,
    D's own TPOT p99 (vLLM's histogram), D's retained share (ON, mean/max) and D's
    preemptions (docs/benchmarking.md)."""

    def pair(a: float | None, b: float | None, spec: str, width: int) -> str:
        def one(v: float | None) -> str:
            return "n/a" if v is None else format(v, spec)

        return f"{one(a)}/{one(b)}".rjust(width)

    def share(v: float | None) -> str:
        return "n/a" if v is None else f"{v * 100:.0f}%"

    lines = [
        f"{'prefix':>8} {'TTFT OFF/ON':>13} {'TPOT p50 OFF/ON':>16} {'TPOT p99 OFF/ON':>16} "
        f"{'p99 ON/OFF':>10} {'ITL p99 OFF/ON':>15} {'D TPOT p99 OFF/ON':>18} "
        f"{'D retained ON':>14} {'preempt OFF/ON':>15}"
    ]
    for r in decode_rows(summary):
        reg = r["tpot_p99_regression_pct"]
        lines.append(
            f"{r['point']:>8} {pair(r['ttft_off_ms'], r['ttft_on_ms'], '.0f', 13)} "
            f"{pair(r['tpot_p50_off'], r['tpot_p50_on'], '.2f', 16)} "
            f"{pair(r['tpot_p99_off'], r['tpot_p99_on'], '.2f', 16)} "
            f"{'n/a' if reg is None else f'{reg:+.1f}%':>10} "
            f"{pair(r['itl_p99_off'], r['itl_p99_on'], '.2f', 15)} "
            f"{pair(r['d_tpot_p99_off'], r['d_tpot_p99_on'], '.1f', 18)} "
            f"{share(r['retained_mean_on']) + '/' + share(r['retained_max_on']):>14} "
            f"{pair(r['preemptions_off'], r['preemptions_on'], '.0f', 15)}"
        )
    return "\n".join(lines)


def render_concurrency_dir(path: Path, min_turn: int = 2, plots: bool = True) -> tuple[Path, str]:
    """A ``bench --concurrency`` directory: each level's report, then ``concurrency.md``
    and ``concurrency.png`` over the levels (without ``plots``: no PNG anywhere);
    returns (report path, console text)."""
    levels = load_levels(path, min_turn)
    for level, _ in levels:
        render_dir(level_dir(path, level), min_turn=min_turn, plots=plots)
    manifest = levels[0][1].result.manifest
    output_tokens = int((manifest.get("workload") or {}).get("output_tokens") or 1)
    p_cache = bool(((manifest.get("engines") or {}).get("prefix_caching") or {}).get("prefill"))
    rows = concurrency_rows(levels, output_tokens)
    written = [str(write_concurrency_plot(rows, path, p_cache))] if plots else []
    md = render_concurrency(path.name, rows, output_tokens, p_cache, written)
    report = path / "concurrency.md"
    report.write_text(md)
    lines = [
        f"{'level':>6} {'prefix':>7} {'TTFT OFF/ON':>13} {'TPOT p99 OFF/ON':>16} "
        f"{'net ms/turn':>12}"
    ]
    for r in rows:

        def v(x: float | None, spec: str) -> str:
            return "n/a" if x is None else format(x, spec)

        lines.append(
            f"{r['level']:>6} {r['point']:>7} "
            f"{v(r['ttft_off'], '.0f') + '/' + v(r['ttft_on'], '.0f'):>13} "
            f"{v(r['tpot_p99_off'], '.2f') + '/' + v(r['tpot_p99_on'], '.2f'):>16} "
            f"{v(r['net_saving_ms'], '+.0f'):>12}"
        )
    return report, "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bidir-kv report",
        description="Render bench result directories: report.md, ttft.png, prefill.png, "
        "decode.png (a --concurrency sweep: concurrency.md and concurrency.png too).",
    )
    ap.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="bench result directory")
    ap.add_argument(
        "--out", type=Path, default=None, help="output folder (only with one DIR; default: DIR)"
    )
    ap.add_argument(
        "--min-turn",
        type=int,
        default=2,
        help="TTFT statistics use turns >= this (default 2: turn 1 misses in both legs)",
    )
    ap.add_argument(
        "--no-plots",
        dest="plots",
        action="store_false",
        help="write report.md and print the tables only, no PNG plots",
    )
    args = ap.parse_args(argv)
    if args.out is not None and len(args.dirs) > 1:
        ap.error("--out needs exactly one DIR")
    rc = 0
    for d in args.dirs:
        try:
            if (d / CONCURRENCY_FILE).is_file():
                report_path, table = render_concurrency_dir(d, args.min_turn, args.plots)
                print(f"== {d} (concurrency sweep)")
                print(table)
                plot = f"  plot: {d / 'concurrency.png'}" if args.plots else ""
                print(f"report: {report_path}{plot}")
                continue
            report_path, table = render_dir(d, args.out, args.min_turn, args.plots)
        except (ResultError, ValueError, OSError) as exc:
            print(f"bidir-kv report: {d}: {exc}", file=sys.stderr)
            rc = 1
            continue
        print(f"== {d}")
        print(table)
        names = ("ttft.png", "prefill.png", "decode.png") if args.plots else ()
        plots = ", ".join(str(report_path.parent / n) for n in names)
        print(f"report: {report_path}" + (f"  plots: {plots}" if plots else ""))
    return rc
