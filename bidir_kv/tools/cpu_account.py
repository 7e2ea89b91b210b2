"""CPU time of a process and its live children, from the kernel's own accounting.

``/proc/<pid>/stat`` fields 14 and 15 (utime, stime) in clock ticks; children are
read from ``/proc/<pid>/task/<pid>/children`` so the workers of ``bidir-kv proxy
--workers N`` count towards their parent. Linux only (``None`` elsewhere).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cpu_seconds"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _own(pid: int) -> float | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces; fields after it are split safely
    rest = stat[stat.rindex(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / _TICK  # utime, stime


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` and its descendants now alive."""
    own = _own(pid)
    if own is None:
        return None
    return own + sum(cpu_seconds(c) or 0.0 for c in _children(pid))
