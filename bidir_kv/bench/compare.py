"""Connectors side by side: each ON leg of another connector against the reference ON leg.

A session run with ``--connector stock,bidir-kv`` has the legs ``off``, ``on`` (the
reference connector) and ``on+bidir-kv``. Per prefix length and leg this reduces TTFT
(the client's records, as the rest of the summary) and P's prefill duration (each
request's P leg from the router log, ``split.prefill_by_turn``) to median and p90 over
the turns ``>= min_turn``, and gives each other connector's ON leg over the reference ON
leg for the four figures (> 1: the other connector is slower). vLLM's own mean prefill
time on P (``vllm:request_prefill_time_seconds``, every turn) is beside them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bidir_kv.bench.split import point_log, prefill_by_turn
from bidir_kv.bench.stats import percentile
from bidir_kv.bench.summary import Summary
from bidir_kv.bench.topo import leg_feature

__all__ = [
    "ConnectorPoint",
    "LegFigures",
    "LegRatio",
    "compared_legs",
    "connector_points",
    "connector_table",
]


@dataclass(frozen=True)
class LegFigures:
    """One leg at one point; milliseconds, NaN when nothing was measured."""

    leg: str
    connector: str | None
    ttft_n: int
    ttft_median: float
    ttft_p90: float
    prefill_n: int
    prefill_median: float
    prefill_p90: float
    prefill_all_turns: bool  # the log named no conversations: every turn is in
    engine_prefill_ms: float | None


@dataclass(frozen=True)
class LegRatio:
    """``leg`` over ``reference`` (the reference connector's ON leg) at one point."""

    leg: str
    reference: str
    ttft_median: float | None
    ttft_p90: float | None
    prefill_median: float | None
    prefill_p90: float | None


@dataclass(frozen=True)
class ConnectorPoint:
    point: int
    legs: list[LegFigures]
    ratios: list[LegRatio]


def compared_legs(summary: Summary) -> list[str]:
    """The ON legs of connectors other than the reference (``on+<connector>``)."""
    return [leg for leg in summary.result.legs if leg != "on" and leg_feature(leg) == "on"]


def _figures(summary: Summary, leg: str, point: int) -> LegFigures | None:
    row = summary.get(leg, point)
    if row is None:
        return None
    samples = prefill_by_turn(point_log(summary.result.manifest, leg, point))
    known = any(turn is not None for turn, _ in samples)
    prefill = [
        ms for turn, ms in samples if not known or (turn is not None and turn >= summary.min_turn)
    ]
    return LegFigures(
        leg=leg,
        connector=summary.result.connector_of(leg),
        ttft_n=row.ttft_n,
        ttft_median=row.ttft_median,
        ttft_p90=row.ttft_p90,
        prefill_n=len(prefill),
        prefill_median=percentile(prefill, 50),
        prefill_p90=percentile(prefill, 90),
        prefill_all_turns=bool(samples) and not known,
        engine_prefill_ms=row.engine_prefill_ms,
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return None
    return a / b


def connector_points(summary: Summary) -> list[ConnectorPoint]:
    """Per point: every leg's figures and each compared leg over ``on`` ([] when the
    session ran one connector)."""
    others = compared_legs(summary)
    if not others:
        return []
    out = []
    for point in summary.result.prefix_points:
        legs = [f for leg in summary.result.legs if (f := _figures(summary, leg, point))]
        ref = next((f for f in legs if f.leg == "on"), None)
        ratios = [
            LegRatio(
                leg=f.leg,
                reference="on",
                ttft_median=_ratio(f.ttft_median, ref.ttft_median if ref else None),
                ttft_p90=_ratio(f.ttft_p90, ref.ttft_p90 if ref else None),
                prefill_median=_ratio(f.prefill_median, ref.prefill_median if ref else None),
                prefill_p90=_ratio(f.prefill_p90, ref.prefill_p90 if ref else None),
            )
            for f in legs
            if f.leg in others
        ]
        out.append(ConnectorPoint(point, legs, ratios))
    return out


def _f(v: float | None, spec: str) -> str:
    return "n/a" if v is None or math.isnan(v) else format(v, spec)


def connector_table(summary: Summary) -> str:
    """Plain-text side-by-side table for the console ("" for one connector)."""
    points = connector_points(summary)
    if not points:
        return ""
    ref = summary.result.connector_of("on") or "reference"
    lines = [
        f"P prefill (router, per request) and TTFT, turns >= {summary.min_turn}; "
        f"ratio = leg / on ({ref})",
        f"{'prefix':>7} {'leg':<14} {'connector':<9} {'TTFT p50':>9} {'p90':>8} "
        f"{'P prefill p50':>13} {'p90':>8} {'n':>4}",
    ]
    for cp in points:
        for f in cp.legs:
            lines.append(
                f"{cp.point:>7} {f.leg:<14} {f.connector or '?':<9} "
                f"{_f(f.ttft_median, '9.1f'):>9} {_f(f.ttft_p90, '8.1f'):>8} "
                f"{_f(f.prefill_median, '13.1f'):>13} {_f(f.prefill_p90, '8.1f'):>8} "
                f"{f.prefill_n:>4}"
            )
        for r in cp.ratios:
            lines.append(
                f"{cp.point:>7} {r.leg + '/' + r.reference:<24} "
                f"{_f(r.ttft_median, '8.3f'):>8}× {_f(r.ttft_p90, '7.3f'):>7}× "
                f"{_f(r.prefill_median, '12.3f'):>12}× {_f(r.prefill_p90, '7.3f'):>7}×"
            )
    return "\n".join(lines)
