"""A bench result reduced to numbers: one row per (leg, point) and the OFF/ON ratios.

This is the data model the renderer (``report``), the prediction (``predict``)
and the calibration (``calibrate``) share; each figure is computed here once,
and nothing here draws or formats.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from bidir_kv.bench.results import LegPoint, ResultDir, ResultError, load_result, summarize_point

__all__ = [
    "ConcurrencyRow",
    "DecodeRow",
    "RatioRow",
    "Summary",
    "concurrency_rows",
    "decode_rows",
    "load_levels",
    "paying_limit",
    "ratio_rows",
    "regression_pct",
    "summarize_result",
    "working_set_limit",
]


@dataclass
class Summary:
    """Every (leg, point) of a result reduced with the same ``min_turn``."""

    result: ResultDir
    rows: list[LegPoint]
    min_turn: int

    def get(self, leg: str, point: int) -> LegPoint | None:
        return next((r for r in self.rows if r.leg == leg and r.point == point), None)


class RatioRow(TypedDict):
    """OFF and ON TTFT medians of one point and the two OFF/ON ratios (> 1: ON is faster)."""

    point: int
    ttft_off_ms: float | None
    ttft_on_ms: float | None
    ttft_ratio: float | None
    prefill_ratio: float | None


def summarize_result(result: ResultDir, min_turn: int = 2) -> Summary:
    rows = [
        summarize_point(leg, point, recs, info, min_turn=min_turn)
        for (leg, point), (recs, info) in sorted(result.points.items())
    ]
    return Summary(result, rows, min_turn)


def ratio_rows(summary: Summary) -> list[RatioRow]:
    """Per point: OFF and ON TTFT medians, TTFT OFF/ON and router prefill OFF/ON."""
    out: list[RatioRow] = []
    for point in summary.result.prefix_points:
        off, on = summary.get("off", point), summary.get("on", point)
        ratio = None
        if off and on and on.ttft_median and not math.isnan(on.ttft_median):
            ratio = off.ttft_median / on.ttft_median
        prefill_ratio = None
        if off and on and off.prefill_ms and on.prefill_ms:
            prefill_ratio = off.prefill_ms / on.prefill_ms
        out.append(
            RatioRow(
                point=point,
                ttft_off_ms=off.ttft_median if off else None,
                ttft_on_ms=on.ttft_median if on else None,
                ttft_ratio=ratio,
                prefill_ratio=prefill_ratio,
            )
        )
    return out


class DecodeRow(TypedDict):
    """What the decode side paid at one point, OFF beside ON (times in ms, shares 0-1):
    TPOT and ITL percentiles, D's retained share and KV usage, D's preemptions, and TPOT
    p99's regression ON over OFF in percent (> 0: ON decodes slower)."""

    point: int
    ttft_off_ms: float | None
    ttft_on_ms: float | None
    tpot_p50_off: float | None
    tpot_p50_on: float | None
    tpot_p99_off: float | None
    tpot_p99_on: float | None
    itl_p50_off: float | None
    itl_p50_on: float | None
    itl_p99_off: float | None
    itl_p99_on: float | None
    tpot_p99_regression_pct: float | None
    # D's own histograms (vLLM's names), every request of the point
    d_tpot_p99_off: float | None
    d_tpot_p99_on: float | None
    d_itl_p99_off: float | None
    d_itl_p99_on: float | None
    retained_mean_on: float | None
    retained_max_on: float | None
    retained_source: str
    usage_mean_off: float | None
    usage_mean_on: float | None
    preemptions_off: float | None
    preemptions_on: float | None


def _num(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) else v


def regression_pct(off: float | None, on: float | None) -> float | None:
    """``on`` over ``off`` in percent above 100 (None when either is missing)."""
    if off is None or on is None or math.isnan(off) or math.isnan(on) or off <= 0:
        return None
    return (on / off - 1.0) * 100.0


def decode_rows(summary: Summary, on_leg: str = "on") -> list[DecodeRow]:
    """Per point: the decode side of OFF and of ``on_leg``."""
    out: list[DecodeRow] = []
    for point in summary.result.prefix_points:
        off, on = summary.get("off", point), summary.get(on_leg, point)

        def f(row: LegPoint | None, name: str) -> float | None:
            return None if row is None else _num(getattr(row, name))

        out.append(
            DecodeRow(
                point=point,
                ttft_off_ms=f(off, "ttft_median"),
                ttft_on_ms=f(on, "ttft_median"),
                tpot_p50_off=f(off, "tpot_p50"),
                tpot_p50_on=f(on, "tpot_p50"),
                tpot_p99_off=f(off, "tpot_p99"),
                tpot_p99_on=f(on, "tpot_p99"),
                itl_p50_off=f(off, "itl_p50"),
                itl_p50_on=f(on, "itl_p50"),
                itl_p99_off=f(off, "itl_p99"),
                itl_p99_on=f(on, "itl_p99"),
                tpot_p99_regression_pct=regression_pct(f(off, "tpot_p99"), f(on, "tpot_p99")),
                d_tpot_p99_off=f(off, "d_tpot_p99"),
                d_tpot_p99_on=f(on, "d_tpot_p99"),
                d_itl_p99_off=f(off, "d_itl_p99"),
                d_itl_p99_on=f(on, "d_itl_p99"),
                retained_mean_on=f(on, "d_retained_mean"),
                retained_max_on=f(on, "d_retained_max"),
                retained_source=on.d_retained_source if on else "none",
                usage_mean_off=f(off, "d_usage_mean"),
                usage_mean_on=f(on, "d_usage_mean"),
                preemptions_off=off.d_preemptions if off else None,
                preemptions_on=on.d_preemptions if on else None,
            )
        )
    return out


def load_levels(path: Path, min_turn: int = 2) -> list[tuple[int, Summary]]:
    """The levels of a ``bench --concurrency`` directory (``concurrency.json``), each
    summarized; raises :class:`ResultError` when ``path`` is not one."""
    index = path / "concurrency.json"
    if not index.is_file():
        raise ResultError(f"{path}: no concurrency.json (not a bench --concurrency result)")
    doc = json.loads(index.read_text())
    out = []
    for entry in doc.get("levels") or []:
        sub = path / str(entry["dir"])
        if sub.is_dir() and any(sub.glob("*/p*.stats.json")):
            out.append((int(entry["level"]), summarize_result(load_result(sub), min_turn)))
    if not out:
        raise ResultError(f"{path}: concurrency.json lists no level with results")
    return out


class ConcurrencyRow(TypedDict):
    """One (level, prefix point): TTFT and TPOT OFF/ON, the whole answer's latency, what
    ON saves per turn, D's memory, and where P's prompt tokens came from in each leg."""

    level: int
    point: int
    ttft_off: float | None
    ttft_on: float | None
    tpot_p50_off: float | None
    tpot_p50_on: float | None
    tpot_p99_off: float | None
    tpot_p99_on: float | None
    latency_off: float | None
    latency_on: float | None
    # TTFT saved minus what the slower decode adds to the answer (TPOT p50 difference ×
    # (output tokens − 1)); ms per turn, > 0: ON pays
    net_saving_ms: float | None
    retained_mean_on: float | None
    preemptions_off: float | None
    preemptions_on: float | None
    # shares of P's prompt tokens (all turns): P's own cache, D's read-back, computed
    p_cache_off: float | None
    p_cache_on: float | None
    readback_on: float | None
    compute_off: float | None
    compute_on: float | None


def _shares(row: LegPoint | None) -> tuple[float | None, float | None, float | None]:
    if row is None:
        return None, None, None
    total = row.tokens_local_cache_hit + row.tokens_external + row.tokens_local_compute
    if total <= 0:
        return None, None, None
    return (
        row.tokens_local_cache_hit / total,
        row.tokens_external / total,
        row.tokens_local_compute / total,
    )


def concurrency_rows(levels: list[tuple[int, Summary]], output_tokens: int) -> list[ConcurrencyRow]:
    out: list[ConcurrencyRow] = []
    for level, summary in levels:
        for point in summary.result.prefix_points:
            off, on = summary.get("off", point), summary.get("on", point)

            def f(row: LegPoint | None, name: str) -> float | None:
                return None if row is None else _num(getattr(row, name))

            ttft_off, ttft_on = f(off, "ttft_median"), f(on, "ttft_median")
            tpot_off, tpot_on = f(off, "tpot_p50"), f(on, "tpot_p50")
            net = None
            if None not in (ttft_off, ttft_on, tpot_off, tpot_on):
                assert ttft_off is not None and ttft_on is not None
                assert tpot_off is not None and tpot_on is not None
                net = (ttft_off - ttft_on) - (tpot_on - tpot_off) * max(0, output_tokens - 1)
            c_off, _, comp_off = _shares(off)
            c_on, rb_on, comp_on = _shares(on)
            out.append(
                ConcurrencyRow(
                    level=level,
                    point=point,
                    ttft_off=ttft_off,
                    ttft_on=ttft_on,
                    tpot_p50_off=tpot_off,
                    tpot_p50_on=tpot_on,
                    tpot_p99_off=f(off, "tpot_p99"),
                    tpot_p99_on=f(on, "tpot_p99"),
                    latency_off=f(off, "latency_p50"),
                    latency_on=f(on, "latency_p50"),
                    net_saving_ms=net,
                    retained_mean_on=f(on, "d_retained_mean"),
                    preemptions_off=off.d_preemptions if off else None,
                    preemptions_on=on.d_preemptions if on else None,
                    p_cache_off=c_off,
                    p_cache_on=c_on,
                    readback_on=rb_on,
                    compute_off=comp_off,
                    compute_on=comp_on,
                )
            )
    return out


def paying_limit(rows: list[ConcurrencyRow], point: int) -> tuple[int | None, int | None]:
    """At ``point``: the lowest level at which ON saves time per turn, and the first level
    above it at which it no longer does (None: not within the sweep)."""
    mine = sorted((r for r in rows if r["point"] == point), key=lambda r: r["level"])
    first_paying = None
    for r in mine:
        net = r["net_saving_ms"]
        if net is None:
            continue
        if net > 0 and first_paying is None:
            first_paying = r["level"]
        elif net <= 0 and first_paying is not None:
            return first_paying, r["level"]
    return first_paying, None


def working_set_limit(
    rows: list[ConcurrencyRow], point: int, *, gain: float = 0.05
) -> tuple[int | None, int | None]:
    """With P's own prefix cache on, at ``point``: the first level at which P's cache no
    longer holds the conversations' histories (OFF's P-cache share of prompt tokens below
    half of what it was at the lowest level), and the first level at which ON read some of
    P's prompt tokens back from D and its TTFT median beats OFF's by more than ``gain``
    (read-back pays). None: not within the sweep."""
    mine = sorted((r for r in rows if r["point"] == point), key=lambda r: r["level"])
    base = next((r["p_cache_off"] for r in mine if r["p_cache_off"] is not None), None)
    spills = next(
        (
            r["level"]
            for r in mine
            if base and r["p_cache_off"] is not None and r["p_cache_off"] < base / 2
        ),
        None,
    )
    pays = next(
        (
            r["level"]
            for r in mine
            if r["ttft_off"]
            and r["ttft_on"] is not None
            and r["ttft_on"] < r["ttft_off"] * (1 - gain)
            and r["readback_on"]  # a gap read-back did not make is not read-back paying
        ),
        None,
    )
    return spills, pays
