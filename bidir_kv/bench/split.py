"""The ON prefill of reuse turns only, split into compute and KV transfer.

The router's prefill histogram mixes turn 1 (a miss in both legs) with the reuse
turns. Its log names each P leg (``[rid] Prefill done in N ms``) and each reuse
(``[rid] ...: sending D's cached blocks to P``); ``bench`` records where every
point's lines are in the router log, so the reuse turns' prefill is averaged
alone. D->P transfers happen only on reuse turns, so P's transfer time divided by
their count is the transfer part of that prefill; compute is the rest.

The same lines give each request's P leg (``prefill_by_turn``): every turn logs its
conversation (``[rid] conv=C: cache MISS`` or ``...: sending D's cached blocks``) before
its P leg, and a conversation's turns run one after another, so the k-th request of
conversation C in a point's span is its turn k. The connector comparison
(``bench/compare.py``) takes the median and p90 of P's prefill over the turns TTFT uses.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bidir_kv.bench.summary import Summary

__all__ = ["log_offsets", "on_prefill_split", "point_log", "prefill_by_turn", "reuse_prefill_ms"]

_DONE = re.compile(r"\[([^\]]+)\] Prefill done in (\d+(?:\.\d+)?)ms")
_REUSE = re.compile(r"\[([^\]]+)\] conv=.*: sending D's cached blocks to P")
# the first line of a turn that names its conversation: a miss or an offer of D's blocks
_CONV = re.compile(r"\[([^\]]+)\] conv=(\S+): (?:cache MISS|sending D's cached blocks)")


def log_offsets(nodes: dict[str, Any]) -> dict[str, int]:
    """Current sizes of the routers' logs (a point's lines start there)."""
    out = {}
    for name, node in nodes.items():
        path = node.get("log")
        if name.startswith("router") and path:
            try:
                out[name] = Path(path).stat().st_size
            except OSError:
                continue
    return out


def reuse_prefill_ms(text: str) -> list[float]:
    """Prefill durations (ms) of the P legs that reused D's blocks, in ``text``."""
    reuse = {m.group(1) for m in _REUSE.finditer(text)}
    return [float(m.group(2)) for m in _DONE.finditer(text) if m.group(1) in reuse]


def prefill_by_turn(text: str) -> list[tuple[int | None, float]]:
    """``(turn, P's prefill ms)`` of every P leg in ``text``, in log order; ``turn`` is
    None when the request named no conversation the router could count (no id sent,
    or recognised by its history, whose label changes every turn)."""
    turns: dict[str, int] = {}
    seen: dict[str, int] = {}
    for m in _CONV.finditer(text):
        rid, conv = m.group(1), m.group(2)
        if rid in turns or conv.startswith("history:"):
            continue
        seen[conv] = seen.get(conv, 0) + 1
        turns[rid] = seen[conv]
    done: dict[str, float] = {}  # the last P leg of a request (a fallback retries it)
    for m in _DONE.finditer(text):
        done.pop(m.group(1), None)
        done[m.group(1)] = float(m.group(2))
    return [(turns.get(rid), ms) for rid, ms in done.items()]


def point_log(manifest: dict[str, Any], leg: str, point: int) -> str:
    """The router log lines ``bench`` recorded for one leg's point ("" if unknown)."""
    run = ((manifest.get("runs") or {}).get(leg) or {}).get(str(point)) or {}
    nodes = (manifest.get("nodes") or {}).get(leg) or {}
    parts = []
    for name, (start, end) in (run.get("router_log") or {}).items():
        path = (nodes.get(name) or {}).get("log")
        if path:
            parts.append(_slice(path, start, end))
    return "".join(parts)


def _slice(path: str, start: int, end: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(max(0, end - start)).decode(errors="replace")
    except OSError:
        return ""


def on_prefill_split(
    summary: Summary, point: int, leg: str = "on"
) -> tuple[float, float, float] | None:
    """(prefill, transfer, compute) ms per reuse turn of an ON leg; None if unknown."""
    durations = reuse_prefill_ms(point_log(summary.result.manifest, leg, point))
    on = summary.get(leg, point)
    if not durations or on is None:
        return None
    prefill = sum(durations) / len(durations)
    xfer_total = (on.xfer_ms_per_transfer or 0.0) * on.xfer_count
    xfer = min(prefill, xfer_total / len(durations))
    return prefill, xfer, prefill - xfer
