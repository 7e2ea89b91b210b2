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

__all__ = ["RatioRow", "Summary", "ratio_rows", "summarize_result"]


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
