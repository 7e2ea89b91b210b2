"""D's KV memory over a sweep point: sampled from its ``/metrics`` while the point runs.

A counter's delta around a point says what happened (preemptions); a gauge says only
what is true at the moment it is read, so D's KV usage and the share of it retained
turns hold are *sampled* every ``interval`` seconds while the requests run (one task
beside the clients, in the same event loop). Names are vLLM's where vLLM has one
(``vllm:kv_cache_usage_perc``, ``vllm:num_requests_running``/``_waiting``); the
retained share is ours (``bidir_kv:kv_cache_retained_perc``), exported by the emulator.
A vLLM D does not export it: there the retained share is read off the samples where D
ran and queued nothing, when every block in use is a retained turn's (docs/benchmarking.md
"Decode side").
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bidir_kv.client import AsyncNodeClient, ClientError
from bidir_kv.scrape import KV_RETAINED, KV_USAGE, MEMORY_WATCHED, RUNNING, WAITING

__all__ = ["DEFAULT_INTERVAL_S", "MemorySampler", "RetainedShare", "memory_summary"]

# a scrape costs the emulator ~3-6 ms of its one event loop (prometheus_client renders
# the whole registry), which a decode step then waits for: once a second keeps that
# below 1 % of D's time and off the ITL p99 of a ~4 ms step (docs/benchmarking.md)
DEFAULT_INTERVAL_S = 1.0
_FIELDS = ("t", "usage", "retained", "running", "waiting")


@dataclass
class MemorySampler:
    """Scrapes each node of ``urls`` every ``interval_s`` until cancelled; ``samples``
    holds per node the columns ``t`` (s from the start), ``usage``, ``retained`` (None
    when the node does not export it), ``running`` and ``waiting``."""

    urls: Mapping[str, str]
    interval_s: float = DEFAULT_INTERVAL_S
    samples: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    failures: int = 0

    async def run(self) -> None:
        if not self.urls or self.interval_s <= 0:
            return
        clients = {name: AsyncNodeClient(url, timeout=5.0) for name, url in self.urls.items()}
        t0 = time.perf_counter()
        try:
            while True:
                for name, client in clients.items():
                    await self._sample(name, client, time.perf_counter() - t0)
                await asyncio.sleep(self.interval_s)
        finally:
            for client in clients.values():
                with contextlib.suppress(Exception):  # closing: nothing left to report
                    await client.aclose()

    async def _sample(self, name: str, client: AsyncNodeClient, t: float) -> None:
        try:
            snap = await client.metrics(MEMORY_WATCHED)
        except ClientError:
            self.failures += 1
            return
        names = snap.names()
        if KV_USAGE not in names:
            return  # not an engine (or not one that reports KV usage)
        cols = self.samples.setdefault(name, {k: [] for k in _FIELDS})
        cols["t"].append(round(t, 3))
        cols["usage"].append(snap.value(KV_USAGE))
        cols["retained"].append(snap.value(KV_RETAINED) if KV_RETAINED in names else None)
        cols["running"].append(snap.value(RUNNING))
        cols["waiting"].append(snap.value(WAITING))

    def to_dict(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "failures": self.failures, "nodes": self.samples}


@dataclass(frozen=True)
class RetainedShare:
    """D's memory over one point: KV usage and the retained share (mean and max over the
    samples), and where the retained share came from."""

    samples: int
    usage_mean: float
    usage_max: float
    retained_mean: float
    retained_max: float
    source: str  # "gauge" (exported), "idle usage" (vLLM: samples with nothing running), "none"


def _stats(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return sum(values) / len(values), max(values)


def memory_summary(info: Mapping[str, Any], prefix: str = "decode") -> RetainedShare | None:
    """The decode nodes' samples of a point's ``metrics.json`` reduced (all D nodes'
    samples pooled); None when the point has none."""
    nodes = ((info.get("memory") or {}).get("nodes")) or {}
    cols = [c for n, c in nodes.items() if n.startswith(prefix) and c.get("t")]
    if not cols:
        return None
    usage = [u for c in cols for u in c["usage"]]
    gauge = [r for c in cols for r in c["retained"] if r is not None]
    if gauge:
        retained, source = gauge, "gauge"
    else:
        retained = [
            u
            for c in cols
            for u, run, wait in zip(c["usage"], c["running"], c["waiting"], strict=True)
            if run == 0 and wait == 0
        ]
        source = "idle usage" if retained else "none"
    u_mean, u_max = _stats(usage)
    r_mean, r_max = _stats(retained)
    return RetainedShare(len(usage), u_mean, u_max, r_mean, r_max, source)
