"""The ON prefill of reuse turns only, split into compute and KV transfer.

The router's prefill histogram mixes turn 1 (a miss in both legs) with the reuse
turns. Its log names each P leg (``[rid] Prefill done in N ms``) and each reuse
(``[rid] ...: sending D's cached blocks to P``); ``bench`` records where every
point's lines are in the router log, so the reuse turns' prefill is averaged
alone. D->P transfers happen only on reuse turns, so P's transfer time divided by
their count is the transfer part of that prefill; compute is the rest.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bidir_kv.bench.summary import Summary

__all__ = ["log_offsets", "on_prefill_split", "reuse_prefill_ms"]

_DONE = re.compile(r"\[([^\]]+)\] Prefill done in (\d+(?:\.\d+)?)ms")
_REUSE = re.compile(r"\[([^\]]+)\] conv=.*: sending D's cached blocks to P")


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


def _slice(path: str, start: int, end: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(max(0, end - start)).decode(errors="replace")
    except OSError:
        return ""


def on_prefill_split(summary: Summary, point: int) -> tuple[float, float, float] | None:
    """(prefill, transfer, compute) ms per reuse turn of the ON leg; None if unknown."""
    manifest = summary.result.manifest
    run = ((manifest.get("runs") or {}).get("on") or {}).get(str(point)) or {}
    logs = run.get("router_log") or {}
    nodes = (manifest.get("nodes") or {}).get("on") or {}
    durations: list[float] = []
    for name, (start, end) in logs.items():
        path = (nodes.get(name) or {}).get("log")
        if path:
            durations += reuse_prefill_ms(_slice(path, start, end))
    on = summary.get("on", point)
    if not durations or on is None:
        return None
    prefill = sum(durations) / len(durations)
    xfer_total = (on.xfer_ms_per_transfer or 0.0) * on.xfer_count
    xfer = min(prefill, xfer_total / len(durations))
    return prefill, xfer, prefill - xfer
