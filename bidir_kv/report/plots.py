"""The publication's two plots from a summarized ``bench`` result.

* ``ttft.png``: TTFT against prompt length, OFF and ON, median with a p10–p90 band.
* ``prefill.png``: prefill duration per prompt length as paired bars; the ON bar
  (reuse turns only, ``split.py``) is stacked into prefill compute and KV transfer
  (as in the AWS blog).
* ``decode.png``: what the decode side paid: TPOT p50 and p99 against prompt length,
  OFF and ON; and D's KV usage and retained share over the run at the longest prompt,
  with each leg's preemptions (docs/benchmarking.md "Decode side").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bidir_kv.bench.split import on_prefill_split
from bidir_kv.bench.summary import ConcurrencyRow, Summary

__all__ = ["write_concurrency_plot", "write_plots"]

_COLORS = {"off": "#c0504d", "on": "#4f81bd"}


def write_plots(summary: Summary, out_dir: Path) -> list[Path]:
    """Write ``ttft.png`` and ``prefill.png``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        _plot_ttft(plt, summary, out_dir),
        _plot_prefill(plt, summary, out_dir),
        _plot_decode(plt, summary, out_dir),
    ]


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_ttft(plt: Any, summary: Summary, out_dir: Path) -> Path:
    points = summary.result.prefix_points
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for leg in summary.result.legs:
        rows = [summary.get(leg, p) for p in points]
        xs = [p for p, r in zip(points, rows, strict=True) if r and r.ttft_n]
        rs = [r for r in rows if r and r.ttft_n]
        if not rs:
            continue
        color = _COLORS.get(leg)
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
    ax.set_ylabel(f"TTFT (ms), turns ≥ {summary.min_turn}")
    ax.set_title("TTFT vs prompt length: bidirectional KV transfer OFF vs ON")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, out_dir / "ttft.png")


def _plot_prefill(plt: Any, summary: Summary, out_dir: Path) -> Path:
    points = summary.result.prefix_points
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.38
    idx = list(range(len(points)))
    off = [summary.get("off", p) for p in points]
    on = [summary.get("on", p) for p in points]
    off_ms = [r.prefill_ms or 0.0 if r else 0.0 for r in off]
    # ON: reuse turns only (turn 1 is a miss in both legs) where the router log says
    # which P legs reused D's blocks; else every request of the point
    splits = [on_prefill_split(summary, p) for p in points]
    on_total = [
        sp[0] if sp else (r.prefill_ms or 0.0 if r else 0.0)
        for sp, r in zip(splits, on, strict=True)
    ]
    on_xfer = [
        sp[1] if sp else (min(r.xfer_ms_per_request or 0.0, t) if r else 0.0)
        for sp, r, t in zip(splits, on, on_total, strict=True)
    ]
    on_compute = [t - x for t, x in zip(on_total, on_xfer, strict=True)]
    ax.bar(
        [i - width / 2 for i in idx], off_ms, width, color=_COLORS["off"], label="OFF: recompute"
    )
    ax.bar(
        [i + width / 2 for i in idx],
        on_compute,
        width,
        color=_COLORS["on"],
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
    return _save(plt, fig, out_dir / "prefill.png")


def _plot_decode(plt: Any, summary: Summary, out_dir: Path) -> Path:
    points = summary.result.prefix_points
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for leg in summary.result.legs:
        rows = [summary.get(leg, p) for p in points]
        got = [(p, r) for p, r in zip(points, rows, strict=True) if r and r.tpot_n]
        if not got:
            continue
        color = _COLORS.get(leg)
        xs = [p for p, _ in got]
        left.plot(xs, [r.tpot_p50 for _, r in got], "o-", color=color, label=f"{leg.upper()} p50")
        left.plot(xs, [r.tpot_p99 for _, r in got], "s--", color=color, label=f"{leg.upper()} p99")
    left.set_xlabel("prefix length (tokens)")
    left.set_ylabel(f"TPOT (ms), turns ≥ {summary.min_turn}")
    left.set_title("TPOT: (latency − TTFT) / (output tokens − 1)")
    left.grid(alpha=0.3)
    left.legend()
    longest = points[-1] if points else None
    drew = False
    for leg in summary.result.legs:
        found = summary.result.points.get((leg, longest)) if longest is not None else None
        nodes = ((found[1].get("memory") or {}).get("nodes") or {}) if found else {}
        cols = next((c for n, c in sorted(nodes.items()) if n.startswith("decode")), None)
        if not cols or not cols.get("t"):
            continue
        row = summary.get(leg, longest) if longest is not None else None
        pre = row.d_preemptions if row else None
        color = _COLORS.get(leg)
        tag = f"{leg.upper()}" + (f", {pre:.0f} preemptions" if pre is not None else "")
        right.plot(cols["t"], cols["usage"], "-", color=color, label=f"{tag}: KV usage")
        retained = [r if r is not None else float("nan") for r in cols["retained"]]
        if any(r == r for r in retained):
            right.plot(cols["t"], retained, ":", color=color, label=f"{leg.upper()}: retained")
        drew = True
    right.set_xlabel("time in the point (s)")
    right.set_ylabel("share of D's KV blocks")
    right.set_ylim(0, 1.05)
    right.set_title(f"D's KV memory at {longest} prefix tokens")
    right.grid(alpha=0.3)
    if drew:
        right.legend(fontsize=8)
    else:
        right.text(
            0.5, 0.5, "D's /metrics were not sampled", ha="center", transform=right.transAxes
        )
    return _save(plt, fig, out_dir / "decode.png")


def write_concurrency_plot(rows: list[ConcurrencyRow], out_dir: Path, p_cache: bool) -> Path:
    """``concurrency.png``: per prompt length, TTFT and TPOT p99 OFF/ON and the net saving
    per turn against the number of concurrent conversations; with P's own cache on, the
    share of P's prompt tokens from its cache and from D's read-back."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 4 if p_cache else 3
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 4.0))
    points = sorted({r["point"] for r in rows})
    styles = ["o-", "s--", "^-.", "d:"]
    for i, point in enumerate(points):
        mine = sorted((r for r in rows if r["point"] == point), key=lambda r: r["level"])
        xs = [r["level"] for r in mine]
        st = styles[i % len(styles)]

        def col(name: str, rs: list[ConcurrencyRow] = mine) -> list[float]:
            return [float("nan") if r[name] is None else float(r[name]) for r in rs]  # type: ignore[literal-required]

        axes[0].plot(xs, col("ttft_off"), st, color=_COLORS["off"], label=f"OFF {point}")
        axes[0].plot(xs, col("ttft_on"), st, color=_COLORS["on"], label=f"ON {point}")
        axes[1].plot(xs, col("tpot_p99_off"), st, color=_COLORS["off"], label=f"OFF {point}")
        axes[1].plot(xs, col("tpot_p99_on"), st, color=_COLORS["on"], label=f"ON {point}")
        axes[2].plot(xs, col("net_saving_ms"), st, color="#8064a2", label=f"{point}")
        if p_cache:
            axes[3].plot(
                xs, col("p_cache_off"), st, color=_COLORS["off"], label=f"OFF P cache {point}"
            )
            axes[3].plot(
                xs, col("p_cache_on"), st, color=_COLORS["on"], label=f"ON P cache {point}"
            )
            axes[3].plot(xs, col("readback_on"), st, color="#9bbb59", label=f"ON read-back {point}")
    titles = ["TTFT median (ms)", "TPOT p99 (ms)", "net saving per turn (ms)"]
    if p_cache:
        titles.append("share of P's prompt tokens")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent conversations")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[2].axhline(0, color="black", lw=0.8)
    return _save(plt, fig, out_dir / "concurrency.png")
