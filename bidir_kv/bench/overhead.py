"""What a run costs this machine: the emulator's own CPU and the machine's load.

An emulated engine pretends work takes the profile's time; the CPU it really burns
per request (tokenizing, writing and hashing KV, moving the scaled bytes, HTTP)
competes with that pretence. ``bench`` records, per point, the CPU seconds of every
node it started (its whole process tree: ``launch.process.cpu_seconds``) and the load
average, so the report can say
how large that overhead is against the emulated ON prefill and when foreign load
makes a headline meaningless (docs/benchmarking.md "Overhead and load").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bidir_kv.launch.process import cpu_seconds

__all__ = [
    "LOAD_LIMIT",
    "OVERHEAD_LIMIT",
    "Load",
    "cpu_seconds",
    "load_now",
    "node_cpu",
    "point_overhead",
]

OVERHEAD_LIMIT = 0.10  # P's CPU per request / emulated ON prefill, at most
LOAD_LIMIT = 1.0  # load average per core above which the machine is busy with others


def node_cpu(pids: Mapping[str, int | None]) -> dict[str, float]:
    """CPU seconds so far of each node that has a live PID."""
    out = {}
    for name, pid in pids.items():
        s = cpu_seconds(pid) if pid else None
        if s is not None:
            out[name] = s
    return out


@dataclass(frozen=True)
class Load:
    load1: float
    cores: int

    @property
    def per_core(self) -> float:
        return self.load1 / max(1, self.cores)


def load_now() -> Load:
    return Load(os.getloadavg()[0], os.cpu_count() or 1)


def point_overhead(
    before: Mapping[str, float],
    after: Mapping[str, float],
    load_before: Load,
    load_after: Load,
    duration_s: float,
    requests: int,
) -> dict[str, Any]:
    """The manifest entry of one point: engine and router CPU, per request, and load."""
    cpu = {n: round(after[n] - before[n], 4) for n in after if n in before}
    engines = sum(v for n, v in cpu.items() if not n.startswith("router"))
    prefill = sum(v for n, v in cpu.items() if n.startswith("prefill"))
    total = sum(cpu.values())
    cores = load_after.cores
    per_request = 1e3 / max(1, requests)
    return {
        "cpu_s": cpu,
        # P's CPU is what competes with the prefill it emulates; D's is mostly decode
        "prefill_cpu_ms_per_request": round(prefill * per_request, 3),
        "engine_cpu_ms_per_request": round(engines * per_request, 3),
        "cpu_ms_per_request": round(total * per_request, 3),
        # share of the machine our own nodes used over the point
        "own_cpu_share": round(total / (duration_s * cores), 4) if duration_s > 0 else None,
        "load1": [round(load_before.load1, 2), round(load_after.load1, 2)],
        "cores": cores,
    }
