"""``report.md`` from a summarized ``bench`` result and its planner prediction.

Formatting only: every number comes from :mod:`bidir_kv.bench.summary` or
:mod:`bidir_kv.plan.predict`; the plots are :mod:`bidir_kv.report.plots`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bidir_kv.bench.compare import connector_points
from bidir_kv.bench.split import on_prefill_split
from bidir_kv.bench.summary import (
    ConcurrencyRow,
    Summary,
    decode_rows,
    paying_limit,
    ratio_rows,
    working_set_limit,
)
from bidir_kv.bench.topo import leg_feature
from bidir_kv.plan.calibrate import CheckRow
from bidir_kv.plan.predict import Prediction
from bidir_kv.plan.tail import tail_text
from bidir_kv.report.headline import headline, headline_text, point_overhead_of

__all__ = ["render_concurrency", "render_markdown"]


def _fmt(v: float | None, spec: str = ".0f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, spec)


def _run_lines(m: Mapping[str, Any]) -> list[str]:
    """What ran: topology, workload, clients, whether it is partial, the client's capacity."""
    if not m:
        return []
    wl = m.get("workload", {})
    lines = [
        f"- topology: `{m.get('topology', 'external')}`, profile: "
        f"`{m.get('profile', 'n/a')}`, model: `{m.get('model', 'n/a')}`",
        f"- workload: {wl.get('num_conversations')} conversations × "
        f"{wl.get('num_turns')} turns, {wl.get('input_tokens')} input and "
        f"{wl.get('output_tokens')} output tokens per turn, think time "
        f"`{wl.get('think_time')}`, seed {wl.get('seed')}",
        f"- clients: {m.get('num_clients')}, max active conversations "
        f"{m.get('max_active_conversations')}",
        f"- history: previous reply sent back `{wl.get('history', 'verbatim')}`, conversation "
        f"ids {'sent' if m.get('send_conversation_id', True) else 'not sent'}; tokens reusable "
        + (
            "from the replies' token ids"
            if m.get("return_token_ids", True)
            else "not known (--no-return-token-ids)"
        ),
    ]
    legs = m.get("leg_connectors") or {}
    if legs:
        lines.append(
            "- KV connector per leg: "
            + ", ".join(f"`{leg}` {conn}" for leg, conn in legs.items())
            + " (stock: vLLM's NixlConnector; bidir-kv: `bidir_kv.connector`)"
        )
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
    return lines


def render_markdown(
    summary: Summary, prediction: Prediction | str, plots: Sequence[str] = ()
) -> str:
    """``report.md``: run description, TTFT and prefill tables, the planner's prediction."""
    lines = [f"# bidir-kv bench report: {summary.result.path.name}", ""]
    lines += _run_lines(summary.result.manifest)
    lines += [
        f"TTFT statistics use turns ≥ {summary.min_turn} (turn 1 is a cache miss in both legs); "
        "prefill duration and KV transfer are averaged over all requests of a point.",
        "",
        "## TTFT per prompt length (ratio = OFF median / ON median)",
        "",
        "| prefix tokens | mean input tokens | OFF median ms | ON median ms | OFF/ON |"
        " OFF p10–p90 ms | ON p10–p90 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in ratio_rows(summary):
        point = int(row["point"] or 0)
        off, on = summary.get("off", point), summary.get("on", point)
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
        " MiB/transfer | ms/transfer | pulled tokens | reusable tokens | pulled/reusable |"
        " P computed tokens | expired | failed | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary.rows:
        share = r.reused_share
        lines.append(
            f"| {r.leg} | {r.point} | {_fmt(r.prefill_ms, '.1f')} "
            f"| {_fmt(r.xfer_ms_per_request, '.2f')} | {r.xfer_count} "
            f"| {_fmt(r.mb_per_transfer, '.2f')} | {_fmt(r.xfer_ms_per_transfer, '.2f')} "
            f"| {r.tokens_external:.0f} | {_fmt(r.tokens_reusable)} "
            f"| {_fmt(None if share is None else 100 * share, '.0f')}"
            f"{'' if share is None else ' %'} "
            f"| {r.tokens_local_compute:.0f} | {r.expired:.0f} | {r.failed:.0f} | {r.errors} |"
        )
    lines += _decode_lines(summary)
    lines += _connector_lines(summary)
    lines += _overhead_lines(summary)
    lines += _prediction_lines(prediction)
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    lines.append("")
    return "\n".join(lines)


def _share(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 100:.0f} %"


def _decode_lines(summary: Summary) -> list[str]:
    """The decode side beside TTFT: what retention can cost (``summary.decode_rows``)."""
    rows = decode_rows(summary)
    lines = [
        "",
        "## Decode side: TPOT, ITL, D's memory and preemptions (OFF / ON)",
        "",
        "TPOT per request = (latency − TTFT) / (output tokens − 1), vLLM's "
        "`benchmark_serving` definition; ITL = every gap between two streamed chunks, "
        "pooled over the requests (a chunk can carry several tokens, then ITL ≫ TPOT). "
        f"Turns ≥ {summary.min_turn}, as TTFT. D's KV usage and retained share are "
        "sampled from D's `/metrics` while the point runs (mean / max); preemptions are the "
        "delta of D's `vllm:num_preemptions_total`. Regression = ON p99 / OFF p99 − 1. "
        "D's own TPOT and ITL p99 come from its `vllm:request_time_per_output_token_seconds` "
        "and `vllm:inter_token_latency_seconds` histograms (every request of the point; "
        "interpolated within buckets, a value in the lowest bucket is its bound).",
        "",
        "| prefix tokens | TTFT median ms | TPOT p50 ms | TPOT p99 ms | TPOT p99 regression"
        " | ITL p50 ms | ITL p99 ms | D's TPOT p99 ms (vLLM) | D's ITL p99 ms (vLLM)"
        " | D retained ON, mean / max | D KV usage mean | D preemptions |",
        "|---:|---|---|---|---:|---|---|---|---|---|---|---|",
    ]
    if _relayed_whole(summary):
        lines[4:4] = [
            "The router relayed D's answers whole (`--decode-stream never`): the client saw "
            "every token at once, so its TPOT and ITL say nothing about decoding; D's own "
            "columns do.",
            "",
        ]
    for r in rows:
        reg = r["tpot_p99_regression_pct"]
        src = "" if r["retained_source"] in ("gauge", "none") else f" ({r['retained_source']})"
        pre_off, pre_on = r["preemptions_off"], r["preemptions_on"]
        lines.append(
            f"| {r['point']} | {_fmt(r['ttft_off_ms'])} / {_fmt(r['ttft_on_ms'])} "
            f"| {_fmt(r['tpot_p50_off'], '.2f')} / {_fmt(r['tpot_p50_on'], '.2f')} "
            f"| {_fmt(r['tpot_p99_off'], '.2f')} / {_fmt(r['tpot_p99_on'], '.2f')} "
            f"| {_fmt(reg, '+.1f')} % "
            f"| {_fmt(r['itl_p50_off'], '.2f')} / {_fmt(r['itl_p50_on'], '.2f')} "
            f"| {_fmt(r['itl_p99_off'], '.2f')} / {_fmt(r['itl_p99_on'], '.2f')} "
            f"| {_fmt(r['d_tpot_p99_off'], '.1f')} / {_fmt(r['d_tpot_p99_on'], '.1f')} "
            f"| {_fmt(r['d_itl_p99_off'], '.1f')} / {_fmt(r['d_itl_p99_on'], '.1f')} "
            f"| {_share(r['retained_mean_on'])} / {_share(r['retained_max_on'])}{src} "
            f"| {_share(r['usage_mean_off'])} / {_share(r['usage_mean_on'])} "
            f"| {_fmt(pre_off)} / {_fmt(pre_on)} |"
        )
    return lines


def _relayed_whole(summary: Summary) -> bool:
    engines = summary.result.manifest.get("engines") or {}
    return engines.get("decode_stream") == "never"


def _connector_lines(summary: Summary) -> list[str]:
    """Each connector's ON leg beside the reference's (``bench/compare.py``)."""
    points = connector_points(summary)
    if not points:
        return []
    ref = summary.result.connector_of("on") or "the reference"
    lines = [
        "",
        f"## Connectors side by side (ratio = leg / `on`, the {ref} connector)",
        "",
        f"TTFT from the client and P's prefill duration from the router log (each request's "
        f"P leg: HTTP to P, any D→P read, compute), median and p90 over turns ≥ "
        f"{summary.min_turn}; vLLM's mean is P's own `vllm:request_prefill_time_seconds` "
        "over every turn. A ratio above 1 means the leg is slower than `on`.",
        "",
        "| prefix tokens | leg | connector | TTFT median ms | TTFT p90 ms | P prefill median ms"
        " | P prefill p90 ms | P legs | vLLM P prefill mean ms |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for cp in points:
        for f in cp.legs:
            scope = " (all turns)" if f.prefill_all_turns else ""
            lines.append(
                f"| {cp.point} | `{f.leg}` | {f.connector or 'n/a'} | {_fmt(f.ttft_median, '.1f')}"
                f" | {_fmt(f.ttft_p90, '.1f')} | {_fmt(f.prefill_median, '.1f')}{scope}"
                f" | {_fmt(f.prefill_p90, '.1f')} | {f.prefill_n}"
                f" | {_fmt(f.engine_prefill_ms, '.2f')} |"
            )
        for r in cp.ratios:
            lines.append(
                f"| {cp.point} | **`{r.leg}` / `{r.reference}`** | | "
                f"**{_fmt(r.ttft_median, '.3f')}×** | **{_fmt(r.ttft_p90, '.3f')}×** "
                f"| **{_fmt(r.prefill_median, '.3f')}×** | **{_fmt(r.prefill_p90, '.3f')}×** | | |"
            )
    return lines


def _overhead_lines(summary: Summary) -> list[str]:
    """The headline with its reliability, the ON reuse-turn split, and what the run
    cost this machine per point (``overhead.py``, ``split.py``)."""
    lines = ["", "## Headline, overhead and load", "", headline_text(headline(summary)), ""]
    lines += [
        "| leg | prefix tokens | ON prefill ms, turns ≥ 2 | of which transfer ms | compute ms"
        " | P CPU ms/request | P+D CPU ms/request | our CPU share | load average (start, end) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in summary.rows:
        ov = point_overhead_of(summary, r.leg, r.point)
        sp = on_prefill_split(summary, r.point, r.leg) if leg_feature(r.leg) == "on" else None
        share = ov.get("own_cpu_share")
        lines.append(
            f"| {r.leg} | {r.point} | {_fmt(sp[0] if sp else None, '.1f')} "
            f"| {_fmt(sp[1] if sp else None, '.1f')} | {_fmt(sp[2] if sp else None, '.1f')} "
            f"| {_fmt(ov.get('prefill_cpu_ms_per_request'), '.1f')} "
            f"| {_fmt(ov.get('engine_cpu_ms_per_request'), '.1f')} "
            f"| {_fmt(share * 100 if share is not None else None, '.0f')} % "
            f"| {ov.get('load1', 'n/a')} of {ov.get('cores', 'n/a')} cores |"
        )
    return lines


def _prediction_lines(pred: Prediction | str) -> list[str]:
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
    return lines + _check_lines(pred)


def _check_lines(pred: Prediction) -> list[str]:
    """The calibration next to its own run (docs/profiles.md §6), router prefill in ms."""
    if not pred.check:
        return []
    lines = [
        "",
        "Calibration against its own run (router prefill per request, ms; wait: the "
        "contention inside the prediction):",
        "",
        "| prefix tokens | OFF measured | predicted (wait) | error "
        "| ON measured | predicted (wait) | error |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in pred.check:
        cells = []
        for m, p, w in (
            (r.off_ms, r.off_pred_ms, r.off_wait_ms),
            (r.on_ms, r.on_pred_ms, r.on_wait_ms),
        ):
            err = CheckRow.error(m, p)
            cells.append(
                f"{m:.1f} | {p:.1f} ({w:.1f}) | {err:+.0%}"
                if m is not None and p is not None and err is not None
                else "- | - | -"
            )
        lines.append(f"| {r.point} | {cells[0]} | {cells[1]} |")
    tails = [
        f"- {r.point} {leg}: {tail_text(t)}"
        for r in pred.check
        for leg, t in (("OFF", r.off_tail), ("ON", r.on_tail))
        if t is not None
    ]
    if tails:
        lines += [
            "",
            "Tails of the router's prefill histogram (a miss there is a few requests):",
            *tails,
        ]
    return lines


def render_concurrency(
    title: str, rows: list[ConcurrencyRow], output_tokens: int, p_cache: bool, plots: Sequence[str]
) -> str:
    """``concurrency.md``: per level and prompt length, TTFT and TPOT OFF/ON, what ON
    saves per turn net of its decode cost, D's memory; with P's own cache on, where P's
    prompt tokens came from."""
    lines = [
        f"# bidir-kv concurrency sweep: {title}",
        "",
        "Level = concurrent clients = active conversations. Medians over turns ≥ 2 unless "
        "marked p99. Net saving per turn = (TTFT OFF − TTFT ON) − (TPOT p50 ON − TPOT p50 OFF)"
        f" × {max(0, output_tokens - 1)} further output tokens: above 0 the TTFT gain pays "
        "for the decode cost. D retained = mean share of D's KV blocks; preemptions OFF/ON.",
        "",
        "| level | prefix | TTFT OFF / ON ms | TPOT p50 OFF / ON | TPOT p99 OFF / ON "
        "| answer latency OFF / ON ms | net saving ms/turn | D retained | preemptions |",
        "|---:|---:|---|---|---|---|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['level']} | {r['point']} | {_fmt(r['ttft_off'])} / {_fmt(r['ttft_on'])} "
            f"| {_fmt(r['tpot_p50_off'], '.2f')} / {_fmt(r['tpot_p50_on'], '.2f')} "
            f"| {_fmt(r['tpot_p99_off'], '.2f')} / {_fmt(r['tpot_p99_on'], '.2f')} "
            f"| {_fmt(r['latency_off'])} / {_fmt(r['latency_on'])} "
            f"| {_fmt(r['net_saving_ms'], '+.0f')} | {_share(r['retained_mean_on'])} "
            f"| {_fmt(r['preemptions_off'])} / {_fmt(r['preemptions_on'])} |"
        )
    points = sorted({r["point"] for r in rows})
    lines += ["", "## Where the TTFT gain stops paying", ""]
    for point in points:
        pays, stops = paying_limit(rows, point)
        top = max(r["level"] for r in rows if r["point"] == point)
        if pays is None:
            lines.append(f"- {point} prefix tokens: ON does not pay at any level of the sweep")
        elif stops is None:
            lines.append(
                f"- {point} prefix tokens: ON pays from {pays} concurrent conversations up to "
                f"the highest level run ({top})"
            )
        else:
            lines.append(
                f"- {point} prefix tokens: ON pays from {pays} concurrent conversations and "
                f"stops paying at {stops}"
            )
    if p_cache:
        lines += [
            "",
            "## Where each turn's history came from (P's prompt tokens, all turns)",
            "",
            "P's own prefix cache (`local_cache_hit`), D's read-back (`external_kv_transfer`), "
            "computed (`local_compute`, which includes every turn's new tokens), from P's "
            "`vllm:prompt_tokens_by_source_total`.",
            "",
            "| level | prefix | OFF: P cache / computed | ON: P cache / read-back / computed |",
            "|---:|---:|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['level']} | {r['point']} | {_share(r['p_cache_off'])} / "
                f"{_share(r['compute_off'])} | {_share(r['p_cache_on'])} / "
                f"{_share(r['readback_on'])} / {_share(r['compute_on'])} |"
            )
        lines += [""]
        for point in points:
            spills, pays = working_set_limit(rows, point)
            lines.append(
                f"- {point} prefix tokens: P's cache stops holding the working set at "
                f"{spills if spills is not None else 'no level of the sweep'}; read-back "
                f"starts to pay (some tokens read back, TTFT ON > 5 % below OFF) at "
                f"{pays if pays is not None else 'no level of the sweep'}"
            )
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    lines.append("")
    return "\n".join(lines)
