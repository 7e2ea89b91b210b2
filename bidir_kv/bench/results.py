"""Reading a ``bench`` result directory and reducing it to one row per (leg, point).

Layout written by ``bidir-kv bench``::

    DIR/manifest.json
    DIR/<leg>/p<prefix>.stats.json     vLLM-compatible request records
    DIR/<leg>/p<prefix>.metrics.json   duration + /metrics deltas per node

KV transfer figures come from the prefill nodes (the initiator of D→P reads
records them, docs/protocol.md §11.1); prefill duration from the router's histogram.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bidir_kv.bench.memory import memory_summary
from bidir_kv.bench.stats import RequestRecord, load_records, percentile
from bidir_kv.bench.topo import leg_connector, leg_feature
from bidir_kv.errors import ConfigError
from bidir_kv.scrape import D_ITL, D_TPOT, PREEMPTIONS

__all__ = [
    "LegPoint",
    "ResultDir",
    "ResultError",
    "load_result",
    "prefill_duration_from_rows",
    "summarize_point",
]

XFER_TIME = "vllm:nixl_xfer_time_seconds"
XFER_BYTES = "vllm:nixl_bytes_transferred"
XFER_DESCRIPTORS = "vllm:nixl_num_descriptors"
TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
FAILED = "vllm:nixl_num_failed_transfers_total"
# vLLM's own per-request prefill time on P (scheduled to first token), every turn
ENGINE_PREFILL = "vllm:request_prefill_time_seconds"
# the router's prefill-duration histogram; first match wins
PREFILL_HISTOGRAMS = (
    "bidir_kv:router_prefill_duration_seconds",
    "bidir_kv_router_prefill_duration_seconds",
    "router_prefill_duration_seconds",
)
_PREFILL_RE = re.compile(r"prefill.*(duration|latency|time).*seconds$")


class ResultError(ConfigError):
    """A result directory that is missing or malformed."""


@dataclass
class LegPoint:
    """One leg at one sweep point, reduced. Times in milliseconds; ``None`` = not measured."""

    leg: str
    point: int
    requests: int
    errors: int
    ttft_n: int
    ttft_median: float
    ttft_p10: float
    ttft_p90: float
    ttft_mean: float
    input_tokens_mean: float
    prefill_ms: float | None
    prefill_count: int
    xfer_ms_per_request: float | None
    xfer_ms_per_transfer: float | None
    xfer_count: int
    mb_per_transfer: float | None
    descriptors_per_transfer: float | None
    tokens_external: float
    tokens_local_compute: float
    tokens_local_cache_hit: float
    expired: float
    failed: float
    duration_s: float
    interrupted: bool
    # mean of P's ``vllm:request_prefill_time_seconds`` (vLLM engines only), all turns
    engine_prefill_ms: float | None = None
    # the decode side (docs/benchmarking.md "Decode side"), same turns as TTFT: TPOT per
    # request (latency - TTFT) / (output tokens - 1), ITL every gap between chunks
    tpot_n: int = 0
    tpot_p50: float = math.nan
    tpot_p99: float = math.nan
    tpot_mean: float = math.nan
    itl_n: int = 0
    itl_p50: float = math.nan
    itl_p99: float = math.nan
    # D's KV memory sampled during the point (bench/memory.py), shares 0-1; preemptions
    # are the delta of D's vllm:num_preemptions_total
    d_usage_mean: float = math.nan
    d_usage_max: float = math.nan
    d_retained_mean: float = math.nan
    d_retained_max: float = math.nan
    d_retained_source: str = "none"
    d_preemptions: float | None = None
    # prompt tokens D's retained previous turns could have served (bench/reuse.py), the
    # yardstick of tokens_external; None: not known (no token ids)
    tokens_reusable: float | None = None
    # D's own view (vLLM's histograms, every request of the point): per-request TPOT
    # (vllm:request_time_per_output_token_seconds) and ITL (vllm:inter_token_latency_seconds),
    # quantiles interpolated within buckets as Prometheus' histogram_quantile does; ms
    d_tpot_p50: float = math.nan
    d_tpot_p99: float = math.nan
    d_itl_p50: float = math.nan
    d_itl_p99: float = math.nan
    latency_p50: float = math.nan  # whole answer at the client, same turns as TTFT

    @property
    def reused_share(self) -> float | None:
        """Tokens P read from D over tokens reusable (None: nothing reusable, or unknown)."""
        if not self.tokens_reusable:
            return None
        return self.tokens_external / self.tokens_reusable


@dataclass
class ResultDir:
    path: Path
    manifest: dict[str, Any]
    points: dict[tuple[str, int], tuple[list[RequestRecord], dict[str, Any]]]

    @property
    def legs(self) -> list[str]:
        """OFF, ON, then each ON leg of another connector (``on+bidir-kv``)."""
        order = {"off": 0, "on": 1}
        return sorted(
            {leg for leg, _ in self.points},
            key=lambda s: (order.get(leg_feature(s), 9), s != leg_feature(s), s),
        )

    @property
    def reference_connector(self) -> str | None:
        """The connector ``off`` and ``on`` ran with (None: not recorded, e.g. --url)."""
        return self.manifest.get("connector")

    def connector_of(self, leg: str) -> str | None:
        recorded = (self.manifest.get("leg_connectors") or {}).get(leg)
        if recorded:
            return str(recorded)
        if leg != leg_feature(leg):  # on+<connector> names its own
            return leg_connector(leg)
        return self.reference_connector

    @property
    def prefix_points(self) -> list[int]:
        return sorted({p for _, p in self.points})


def load_result(path: Path) -> ResultDir:
    if not path.is_dir():
        raise ResultError(f"{path}: not a directory")
    manifest_path = path / "manifest.json"
    manifest: dict[str, Any] = {}
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
    points: dict[tuple[str, int], tuple[list[RequestRecord], dict[str, Any]]] = {}
    for stats in sorted(path.glob("*/p*.stats.json")):
        leg = stats.parent.name
        m = re.fullmatch(r"p(\d+)\.stats\.json", stats.name)
        if not m:
            continue
        point = int(m.group(1))
        records = load_records(stats)
        mpath = stats.with_name(stats.name.replace(".stats.json", ".metrics.json"))
        info = json.loads(mpath.read_text()) if mpath.is_file() else {}
        points[(leg, point)] = (records, info)
    if not points:
        raise ResultError(f"{path}: no <leg>/p<N>.stats.json files (is this a bench result?)")
    return ResultDir(path, manifest, points)


def _rows(info: Mapping[str, Any], prefix: str) -> Iterable[tuple[str, dict[str, str], float]]:
    for node, rows in (info.get("metrics_delta") or {}).items():
        if node.startswith(prefix) and rows:
            for name, labels, value in rows:
                yield name, labels, float(value)


def _sum(rows: Iterable[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(
        v for n, lab, v in rows if n == name and all(lab.get(k) == x for k, x in labels.items())
    )


def prefill_histogram_base(rows: Sequence[tuple[str, dict[str, str], float]]) -> str | None:
    """The router's prefill histogram name (without ``_sum``), if the router exports one."""
    names = {n for n, _, _ in rows}
    base = next((h for h in PREFILL_HISTOGRAMS if f"{h}_sum" in names), None)
    if base is None:
        base = next(
            (
                n[: -len("_sum")]
                for n in sorted(names)
                if n.endswith("_sum") and _PREFILL_RE.search(n[: -len("_sum")])
            ),
            None,
        )
    return base


def prefill_duration_from_rows(
    rows: Sequence[tuple[str, dict[str, str], float]],
) -> tuple[float, int] | None:
    """(sum seconds, count) of the router's prefill histogram, if the router exports one."""
    base = prefill_histogram_base(rows)
    if base is None:
        return None
    # failed P legs (timeouts) would distort the mean: only the router's ok outcomes
    ok_rows = [(n, lab, v) for n, lab, v in rows if lab.get("outcome", "ok") == "ok"]
    total = _sum(ok_rows, f"{base}_sum")
    count = int(_sum(ok_rows, f"{base}_count"))
    return total, count


def summarize_point(
    leg: str,
    point: int,
    records: Sequence[RequestRecord],
    info: Mapping[str, Any],
    min_turn: int = 2,
) -> LegPoint:
    ok = [r for r in records if r.ok and r.turn >= min_turn]
    ttft = [r.ttft_ms for r in ok]
    p_rows = list(_rows(info, "prefill"))
    r_rows = list(_rows(info, "router"))
    prefill = prefill_duration_from_rows(r_rows)
    prefill_ms = prefill[0] * 1e3 / prefill[1] if prefill and prefill[1] else None
    prefill_count = prefill[1] if prefill else 0
    xfer_s = _sum(p_rows, f"{XFER_TIME}_sum")
    xfer_n = int(_sum(p_rows, f"{XFER_TIME}_count"))
    xfer_bytes = _sum(p_rows, f"{XFER_BYTES}_sum")
    requests = len(records) or 1
    engine_n = _sum(p_rows, f"{ENGINE_PREFILL}_count")
    decoded = [r for r in ok if r.output_num_tokens > 1]
    tpot = [r.tpot_ms for r in decoded]
    itl = [g for r in decoded for g in r.itl_ms]
    d_rows = list(_rows(info, "decode"))
    mem = memory_summary(info)
    reusable = [r.reusable_tokens for r in records if r.reusable_tokens is not None]
    return LegPoint(
        leg=leg,
        point=point,
        requests=len(records),
        errors=sum(1 for r in records if not r.ok),
        ttft_n=len(ttft),
        ttft_median=percentile(ttft, 50),
        ttft_p10=percentile(ttft, 10),
        ttft_p90=percentile(ttft, 90),
        ttft_mean=sum(ttft) / len(ttft) if ttft else math.nan,
        input_tokens_mean=sum(r.input_num_tokens for r in ok) / len(ok) if ok else math.nan,
        prefill_ms=prefill_ms,
        prefill_count=prefill_count,
        xfer_ms_per_request=xfer_s * 1e3 / (prefill_count or requests),
        xfer_ms_per_transfer=xfer_s * 1e3 / xfer_n if xfer_n else None,
        xfer_count=xfer_n,
        mb_per_transfer=xfer_bytes / xfer_n / 2**20 if xfer_n else None,
        descriptors_per_transfer=(
            _sum(p_rows, f"{XFER_DESCRIPTORS}_sum") / xfer_n
            if xfer_n and any(n == f"{XFER_DESCRIPTORS}_sum" for n, _, _ in p_rows)
            else None
        ),
        tokens_external=_sum(p_rows, TOKENS_BY_SOURCE, source="external_kv_transfer"),
        tokens_local_compute=_sum(p_rows, TOKENS_BY_SOURCE, source="local_compute"),
        tokens_local_cache_hit=_sum(p_rows, TOKENS_BY_SOURCE, source="local_cache_hit"),
        expired=_sum(p_rows, EXPIRED),
        failed=_sum(p_rows, FAILED),
        duration_s=float(info.get("duration_s", math.nan)),
        interrupted=bool(info.get("interrupted", False)),
        engine_prefill_ms=(
            _sum(p_rows, f"{ENGINE_PREFILL}_sum") * 1e3 / engine_n if engine_n else None
        ),
        tpot_n=len(tpot),
        tpot_p50=percentile(tpot, 50),
        tpot_p99=percentile(tpot, 99),
        tpot_mean=sum(tpot) / len(tpot) if tpot else math.nan,
        itl_n=len(itl),
        itl_p50=percentile(itl, 50),
        itl_p99=percentile(itl, 99),
        d_usage_mean=mem.usage_mean if mem else math.nan,
        d_usage_max=mem.usage_max if mem else math.nan,
        d_retained_mean=mem.retained_mean if mem else math.nan,
        d_retained_max=mem.retained_max if mem else math.nan,
        d_retained_source=mem.source if mem else "none",
        d_preemptions=_decode_preemptions(info, d_rows),
        tokens_reusable=float(sum(reusable)) if reusable else None,
        d_tpot_p50=histogram_quantile(d_rows, D_TPOT, 0.50) * 1e3,
        d_tpot_p99=histogram_quantile(d_rows, D_TPOT, 0.99) * 1e3,
        d_itl_p50=histogram_quantile(d_rows, D_ITL, 0.50) * 1e3,
        d_itl_p99=histogram_quantile(d_rows, D_ITL, 0.99) * 1e3,
        latency_p50=percentile([r.latency_ms for r in ok], 50),
    )


def histogram_quantile(
    rows: Sequence[tuple[str, dict[str, str], float]], base: str, q: float
) -> float:
    """Quantile ``q`` (0-1) of histogram ``base`` from its ``_bucket`` deltas, linear
    within the bucket it falls in (Prometheus' ``histogram_quantile``), except that a
    quantile in the lowest bucket is that bucket's bound (an upper bound: nothing says
    where below it the values lie) and one in ``+Inf`` the last finite bound. NaN
    without observations."""
    cum: dict[float, float] = {}
    for name, labels, value in rows:
        if name == f"{base}_bucket" and "le" in labels:
            le = float(labels["le"])
            cum[le] = cum.get(le, 0.0) + value
    bounds = sorted(cum)
    if not bounds or cum[bounds[-1]] <= 0:
        return math.nan
    total = cum[bounds[-1]]
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le in bounds:
        c = cum[le]
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c or prev_c == 0:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def _decode_preemptions(
    info: Mapping[str, Any], d_rows: Sequence[tuple[str, dict[str, str], float]]
) -> float | None:
    """D's preemptions during the point; None when no D node was scraped (``--url``
    without ``--metrics-url decode=...``): unknown, not zero."""
    scraped = [n for n, rows in (info.get("metrics_delta") or {}).items() if n.startswith("decode")]
    if not scraped or all((info["metrics_delta"][n] is None) for n in scraped):
        return None
    return _sum(d_rows, PREEMPTIONS)
