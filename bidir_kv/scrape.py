"""Reading Prometheus ``/metrics`` of engines and routers: snapshots, deltas, vLLM's names.

Tests, conformance scenarios, ``bench`` and ``doctor`` all prove "who computed what"
the same way: scrape before, scrape after, compare. Absolute values are never
asserted (nodes are shared between tests; docs/vllm-cpu.md §7.7). This module parses
the exposition format; fetching it is :func:`bidir_kv.client.scrape`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "CACHED_BY_SOURCE",
    "CACHE_CONFIG_INFO",
    "D_ITL",
    "D_TPOT",
    "KV_RETAINED",
    "KV_USAGE",
    "MEMORY_WATCHED",
    "NIXL_BYTES",
    "NIXL_EXPIRED",
    "NIXL_FAILED",
    "NIXL_XFERS",
    "NOTIFS_AFTER_EXPIRY",
    "PREEMPTIONS",
    "RUNNING",
    "SOURCES",
    "TOKENS_BY_SOURCE",
    "WAITING",
    "WATCHED",
    "MetricsSnapshot",
    "parse_metrics",
    "reported_block_size",
    "tokens_by_source",
]

# vLLM's counters that show who computed what and what moved (engines export the same)
TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
NIXL_XFERS = "vllm:nixl_xfer_time_seconds_count"
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"
NIXL_EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
NOTIFS_AFTER_EXPIRY = "vllm:nixl_num_notifications_after_expiry_total"
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
# the counters a P/D turn is judged by (scraped cheaply: only these lines are parsed)
WATCHED = (
    TOKENS_BY_SOURCE,
    NIXL_BYTES,
    NIXL_XFERS,
    NIXL_FAILED,
    NIXL_EXPIRED,
    NOTIFS_AFTER_EXPIRY,
    CACHED_BY_SOURCE,
)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# vLLM's info gauge (always 1) whose labels are the engine's CacheConfig, one sample per
# engine core: ``block_size`` is the size of the blocks its kv_transfer_params list
CACHE_CONFIG_INFO = "vllm:cache_config_info"
# D's memory and its decode-side cost (issue 33): vLLM's gauges and counter, and ours for
# the share of blocks retained turns hold (the emulator; docs/engine.md "Memory")
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_RETAINED = "bidir_kv:kv_cache_retained_perc"
PREEMPTIONS = "vllm:num_preemptions_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
MEMORY_WATCHED = (KV_USAGE, KV_RETAINED, RUNNING, WAITING)
# vLLM's own decode latencies (histograms, seconds): per request and per token
D_TPOT = "vllm:request_time_per_output_token_seconds"
D_ITL = "vllm:inter_token_latency_seconds"

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


def reported_block_size(text: str) -> int | None:
    """The ``block_size`` label of :data:`CACHE_CONFIG_INFO` in ``/metrics`` text;
    ``None`` when no sample carries a usable one. Only that metric's lines are parsed
    (a vLLM scrape is ~50 kB). ``ValueError`` when the engine cores disagree."""
    prefix = CACHE_CONFIG_INFO + "{"
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    sizes = set()
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            value = sample.labels.get("block_size", "")
            if value.isdigit() and int(value) > 0:
                sizes.add(int(value))
    if len(sizes) > 1:
        raise ValueError(f"{CACHE_CONFIG_INFO}: engine cores report block sizes {sorted(sizes)}")
    return sizes.pop() if sizes else None


def tokens_by_source(delta: MetricsSnapshot) -> dict[str, int]:
    """``{source: tokens}`` from a metrics delta (vLLM's per-source prompt counter)."""
    return {s: int(delta.value(TOKENS_BY_SOURCE, source=s)) for s in SOURCES}
