"""Markdown summary and the publication's two plots from a ``bench`` result.

* ``ttft.png``: TTFT against prompt length, OFF and ON, median with a p10–p90 band.
* ``prefill.png``: prefill duration per prompt length as paired bars; the ON bar
  is stacked into prefill compute and KV transfer (as in the AWS blog).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bidir_kv.bench.results import LegPoint, ResultDir, summarize_point

__all__ = ["Report", "build_report", "ratio_rows", "render_markdown", "write_plots"]


@dataclass
class Report:
    result: ResultDir
    rows: list[LegPoint]
    min_turn: int

    def get(self, leg: str, point: int) -> LegPoint | None:
        return next((r for r in self.rows if r.leg == leg and r.point == point), None)


def build_report(result: ResultDir, min_turn: int = 2) -> Report:
    rows = [
        summarize_point(leg, point, recs, info, min_turn=min_turn)
        for (leg, point), (recs, info) in sorted(result.points.items())
    ]
    return Report(result, rows, min_turn)


def _fmt(v: float | None, spec: str = ".0f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, spec)


def ratio_rows(report: Report) -> list[dict[str, float | int | None]]:
    """Per point: OFF and ON TTFT medians and OFF/ON (>1 means ON is faster)."""
    out: list[dict[str, float | int | None]] = []
    for point in report.result.prefix_points:
        off, on = report.get("off", point), report.get("on", point)
        ratio = None
        if off and on and on.ttft_median and not math.isnan(on.ttft_median):
            ratio = off.ttft_median / on.ttft_median
        prefill_ratio = None
        if off and on and off.prefill_ms and on.prefill_ms:
            prefill_ratio = off.prefill_ms / on.prefill_ms
        out.append(
            {
                "point": point,
                "ttft_off_ms": off.ttft_median if off else None,
                "ttft_on_ms": on.ttft_median if on else None,
                "ttft_ratio": ratio,
                "prefill_ratio": prefill_ratio,
            }
        )
    return out


def render_markdown(report: Report, plots: Sequence[str] = ()) -> str:
    m = report.result.manifest
    lines = [f"# bidir-kv bench report: {report.result.path.name}", ""]
    if m:
        wl = m.get("workload", {})
        lines += [
            f"- topology: `{m.get('topology', 'external')}`, profile: "
            f"`{m.get('profile', 'n/a')}`, model: `{m.get('model', 'n/a')}`",
            f"- workload: {wl.get('num_conversations')} conversations × "
            f"{wl.get('num_turns')} turns, {wl.get('input_tokens')} input and "
            f"{wl.get('output_tokens')} output tokens per turn, think time "
            f"`{wl.get('think_time')}`, seed {wl.get('seed')}",
            f"- clients: {m.get('num_clients')}, max active conversations "
            f"{m.get('max_active_conversations')}",
        ]
        if not m.get("complete", True):
            lines.append("- **partial result**: the run was interrupted; missing points are absent")
        cap = m.get("client_capacity")
        if cap:
            lines.append(
                f"- client capacity: {_fmt(cap.get('requests_per_s'))} req/s and "
                f"{_fmt(cap.get('chunks_per_s'))} chunks/s against a trivial server; the "
                f"sweep needed at most {_fmt(cap.get('needed_requests_per_s'), '.1f')} req/s and "
                f"{_fmt(cap.get('needed_chunks_per_s'))} chunks/s (margin "
                f"{_fmt(cap.get('margin'), '.0f')}×)"
            )
        lines.append("")
    lines += [
        f"TTFT statistics use turns ≥ {report.min_turn} (turn 1 is a cache miss in both legs); "
        "prefill duration and KV transfer are averaged over all requests of a point.",
        "",
        "## TTFT per prompt length (ratio = OFF median / ON median)",
        "",
        "| prefix tokens | mean input tokens | OFF median ms | ON median ms | OFF/ON |"
        " OFF p10–p90 ms | ON p10–p90 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in ratio_rows(report):
        point = int(row["point"] or 0)
        off, on = report.get("off", point), report.get("on", point)
        either = on or off
        tokens = either.input_tokens_mean if either else None
        lines.append(
            f"| {point} | {_fmt(tokens)} | {_fmt(row['ttft_off_ms'])} | {_fmt(row['ttft_on_ms'])} "
            f"| {_fmt(row['ttft_ratio'], '.2f')}× "
            f"| {_fmt(off.ttft_p10 if off else None)}–{_fmt(off.ttft_p90 if off else None)} "
            f"| {_fmt(on.ttft_p10 if on else None)}–{_fmt(on.ttft_p90 if on else None)} |"
        )
    lines += [
        "",
        "## Prefill duration and KV transfer (D→P reads, measured on P)",
        "",
        "| leg | prefix tokens | prefill ms (router) | KV transfer ms/request | transfers |"
        " MiB/transfer | ms/transfer | pulled tokens | P computed tokens | expired | failed |"
        " errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report.rows:
        lines.append(
            f"| {r.leg} | {r.point} | {_fmt(r.prefill_ms, '.1f')} "
            f"| {_fmt(r.xfer_ms_per_request, '.2f')} | {r.xfer_count} "
            f"| {_fmt(r.mb_per_transfer, '.2f')} | {_fmt(r.xfer_ms_per_transfer, '.2f')} "
            f"| {r.tokens_external:.0f} | {r.tokens_local_compute:.0f} | {r.expired:.0f} "
            f"| {r.failed:.0f} | {r.errors} |"
        )
    lines += _prediction_lines(report)
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    lines.append("")
    return "\n".join(lines)


def write_plots(report: Report, out_dir: Path) -> list[Path]:
    """Write ``ttft.png`` and ``prefill.png``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    points = report.result.prefix_points
    colors = {"off": "#c0504d", "on": "#4f81bd"}
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for leg in report.result.legs:
        rows = [report.get(leg, p) for p in points]
        xs = [p for p, r in zip(points, rows, strict=True) if r and r.ttft_n]
        rs = [r for r in rows if r and r.ttft_n]
        if not rs:
            continue
        color = colors.get(leg)
        ax.plot(xs, [r.ttft_median for r in rs], "o-", color=color, label=f"{leg.upper()} median")
        ax.fill_between(
            xs,
            [r.ttft_p10 for r in rs],
            [r.ttft_p90 for r in rs],
            color=color,
            alpha=0.2,
            label=f"{leg.upper()} p10–p90",
        )
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel(f"TTFT (ms), turns ≥ {report.min_turn}")
    ax.set_title("TTFT vs prompt length: bidirectional KV transfer OFF vs ON")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / "ttft.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.38
    idx = list(range(len(points)))
    off = [report.get("off", p) for p in points]
    on = [report.get("on", p) for p in points]
    off_ms = [r.prefill_ms or 0.0 if r else 0.0 for r in off]
    on_total = [r.prefill_ms or 0.0 if r else 0.0 for r in on]
    on_xfer = [
        min(r.xfer_ms_per_request or 0.0, t) if r else 0.0
        for r, t in zip(on, on_total, strict=True)
    ]
    on_compute = [t - x for t, x in zip(on_total, on_xfer, strict=True)]
    ax.bar([i - width / 2 for i in idx], off_ms, width, color=colors["off"], label="OFF: recompute")
    ax.bar(
        [i + width / 2 for i in idx],
        on_compute,
        width,
        color=colors["on"],
        label="ON: prefill compute",
    )
    ax.bar(
        [i + width / 2 for i in idx],
        on_xfer,
        width,
        bottom=on_compute,
        color="#9bbb59",
        label="ON: KV transfer (D→P)",
    )
    ax.set_xticks(idx, [str(p) for p in points])
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("prefill duration (ms, router)")
    ax.set_title("Prefill duration: recompute vs KV transfer")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    if not any(off_ms) and not any(on_total):
        ax.text(
            0.5,
            0.5,
            "router exported no prefill-duration histogram",
            ha="center",
            transform=ax.transAxes,
        )
    fig.tight_layout()
    path = out_dir / "prefill.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def _prediction_lines(report: Report) -> list[str]:
    from bidir_kv.bench.predict import predict

    pred = predict(report)
    if isinstance(pred, str):
        return ["", "## Planner prediction", "", f"Not available: {pred}."]
    be = pred.break_even_tokens
    lines = [
        "",
        f"## Planner prediction ({pred.source})",
        "",
        f"Break-even: pulling pays from {be:.0f} history tokens"
        if math.isfinite(be)
        else "Break-even: pulling never pays with this cost model",
        "",
        "| prefix tokens | mean history tokens (turns ≥ 2) | predicted prefill OFF/ON |"
        " measured prefill OFF/ON (all turns) | measured TTFT OFF/ON |",
        "|---:|---:|---:|---:|---:|",
    ]
    for p in pred.points:
        lines.append(
            f"| {p.point} | {p.history_tokens:.0f} | {p.predicted_ratio:.2f}× "
            f"| {_fmt(p.measured_prefill_ratio, '.2f')}× | {_fmt(p.measured_ratio, '.2f')}× |"
        )
    if pred.measured_crossover is not None:
        lo, hi = pred.measured_crossover
        lines += [
            "",
            f"Measured crossover (TTFT): ON starts to win between {lo:.0f} and {hi:.0f} "
            f"history tokens; the planner's break-even is {be:.0f}.",
        ]
    lines.append(
        "\nThe prediction covers P's prefill only; measured TTFT adds D's work, HTTP and "
        "queueing, and measured prefill averages in turn 1 (a miss in both legs)."
    )
    return lines
