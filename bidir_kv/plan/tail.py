"""The tail of a point's router prefill histogram: the few requests that decide a mean.

A calibration predicts the mean prefill per request; one request that took ten
times the others (a machine busy with other work, a first transfer between two
engines) moves a mean of a dozen by far more than any cost term. The router's
histogram shows such requests: ``prefill_tail`` counts those in buckets that begin
at twice the median bucket's upper bound or later, and the least share of the
mean they make, so a miss in the check can be told apart from a wrong term.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from bidir_kv.bench.results import prefill_duration_from_rows, prefill_histogram_base

__all__ = ["Tail", "prefill_tail", "tail_text"]

_FAR = 2.0  # a tail request's bucket begins at this multiple of the median's upper bound


@dataclass(frozen=True)
class Tail:
    requests: int  # in the tail
    of: int  # all (ok) requests of the point
    median_le_s: float  # upper bound of the median bucket
    tail_from_s: float  # lower bound of the first tail bucket
    mean_share_ms: float  # at least this much of the point's mean comes from the tail


def _router_rows(info: Mapping[str, Any]) -> list[tuple[str, dict[str, str], float]]:
    out: list[tuple[str, dict[str, str], float]] = []
    for node, rows in (info.get("metrics_delta") or {}).items():
        if node.startswith("router") and rows:
            out += [(n, lab, float(v)) for n, lab, v in rows]
    return out


def _buckets(
    rows: Iterable[tuple[str, dict[str, str], float]], base: str
) -> list[tuple[float, float]]:
    cum: dict[float, float] = {}
    for name, labels, value in rows:
        if name == f"{base}_bucket" and labels.get("outcome", "ok") == "ok":
            le = math.inf if labels.get("le") == "+Inf" else float(labels.get("le", "nan"))
            cum[le] = cum.get(le, 0.0) + value
    return sorted(cum.items())


def prefill_tail(info: Mapping[str, Any]) -> Tail | None:
    """The point's tail, or None without a router prefill histogram (or no tail)."""
    rows = _router_rows(info)
    found = prefill_duration_from_rows(rows)
    base = prefill_histogram_base(rows)
    if not found or not found[1] or base is None:
        return None
    n = found[1]
    buckets = _buckets(rows, base)
    if not buckets:
        return None
    median_le = next(le for le, c in buckets if c >= n / 2)
    lower, tail, share = 0.0, 0.0, 0.0
    prev_le, below = 0.0, 0.0
    for le, c in buckets:  # each bucket holds (prev_le, le]: its requests took > prev_le
        if prev_le >= _FAR * median_le and c > below:
            lower = lower or prev_le
            tail += c - below
            share += (c - below) * prev_le
        prev_le, below = le, c
    if not tail or not math.isfinite(median_le):
        return None
    return Tail(int(tail), n, median_le, lower, share * 1e3 / n)


def tail_text(t: Tail) -> str:
    """One line: how many requests, how far out, how much of the mean at least."""
    return (
        f"{t.requests} of {t.of} requests took > {t.tail_from_s:g} s (median <= "
        f"{t.median_le_s:g} s): at least {t.mean_share_ms:.0f} ms of the mean"
    )
