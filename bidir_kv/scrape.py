"""Reading Prometheus ``/metrics`` from engines and routers: snapshots and deltas.

Tests, conformance scenarios and ``bench`` all prove "who computed what" the
same way: scrape before, scrape after, compare. Absolute values are never
asserted (nodes are shared between tests; docs/vllm-cpu.md §7.7).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["MetricsSnapshot", "parse_metrics", "scrape"]

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def parse_metrics(text: str) -> dict[SampleKey, float]:
    """Flatten exposition text into ``{(sample_name, sorted_labels): value}``."""
    out: dict[SampleKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            out[key] = float(sample.value)
    return out


@dataclass(frozen=True)
class MetricsSnapshot:
    samples: Mapping[SampleKey, float]

    def value(self, name: str, **labels: str) -> float:
        """Sum of samples named ``name`` whose labels include ``labels`` (0 if none)."""
        want = labels.items()
        return sum(
            v
            for (n, lab), v in self.samples.items()
            if n == name and all(item in lab for item in want)
        )

    def names(self) -> set[str]:
        return {n for n, _ in self.samples}

    def __sub__(self, other: MetricsSnapshot) -> MetricsSnapshot:
        keys: Iterable[SampleKey] = set(self.samples) | set(other.samples)
        return MetricsSnapshot(
            {k: self.samples.get(k, 0.0) - other.samples.get(k, 0.0) for k in keys}
        )


def scrape(base_url: str, timeout: float = 10.0) -> MetricsSnapshot:
    """GET ``{base_url}/metrics`` and parse it."""
    url = base_url.rstrip("/") + "/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    return MetricsSnapshot(parse_metrics(text))
