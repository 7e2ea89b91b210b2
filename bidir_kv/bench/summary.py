"""A bench result reduced to numbers: one row per (leg, point) and the OFF/ON ratios.

This is the data model the renderer (``report``), the prediction (``predict``)
and the calibration (``calibrate``) share; each figure is computed here once,
and nothing here draws or formats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

from bidir_kv.bench.results import LegPoint, ResultDir, summarize_point

__all__ = [
    "DecodeRow",
    "RatioRow",
    "Summary",
    "decode_rows",
    "ratio_rows",
    "regression_pct",
    "summarize_result",
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
