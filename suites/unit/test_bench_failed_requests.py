"""Bench statistics with failed requests.

A failed request is written with ``ok: false`` and a TTFT of 0 (nothing arrived),
as vLLM's multi-turn benchmark records it. Like that benchmark, the statistics
leave failed requests out of every latency figure and count them apart: a point
with failures reports the TTFT of the requests that were served, ``errors`` says
how many were not, and ``requests`` counts both. Written and read back through
the sweep's own files (``write_point`` -> ``load_result`` -> ``summarize_result``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bidir_kv.bench.results import load_result
from bidir_kv.bench.runner import PointResult, write_point
from bidir_kv.bench.stats import RequestRecord, percentile
from bidir_kv.bench.summary import summarize_result


def _record(turn: int, ttft_ms: float, ok: bool = True, tokens: int = 1000) -> RequestRecord:
    return RequestRecord(
        ttft_ms=ttft_ms,
        tpot_ms=5.0 if ok else 0.0,
        latency_ms=ttft_ms + 40.0 if ok else 3.0,
        start_time_ms=10.0 * turn,
        input_num_turns=2 * turn - 1,
        input_num_tokens=tokens,
        output_num_tokens=8 if ok else 0,
        output_num_chunks=8 if ok else 0,
        output_num_first_chunk_tokens=1 if ok else 0,
        approx_cached_percent=50.0,
        conversation_id=f"c{turn}",
        client_id=0,
        leg="on",
        point=1000,
        turn=turn,
        ok=ok,
        error=None if ok else "HTTPStatusError: 502 Bad Gateway",
    )


def test_failed_requests_are_counted_apart_not_averaged_into_latency(tmp_path: Path) -> None:
    served = [_record(2, 100.0), _record(3, 200.0), _record(4, 300.0), _record(5, 400.0)]
    # two turns that failed: zero TTFT (nothing arrived), a different input size
    failed = [_record(3, 0.0, ok=False, tokens=50), _record(4, 0.0, ok=False, tokens=50)]
    records = [served[0], failed[0], served[1], served[2], failed[1], served[3]]
    write_point(tmp_path, "on", 1000, PointResult(records, duration_s=2.0), metrics={})
    result = load_result(tmp_path)
    assert [r.ok for r in result.points[("on", 1000)][0]] == [r.ok for r in records]
    (row,) = summarize_result(result, min_turn=2).rows
    assert row.requests == 6 and row.errors == 2
    assert row.ttft_n == 4  # only the served requests carry a latency
    ttft = [r.ttft_ms for r in served]
    assert row.ttft_mean == pytest.approx(sum(ttft) / 4)  # 250, not 1000 / 6
    assert row.ttft_median == pytest.approx(percentile(ttft, 50))
    assert row.ttft_p10 == pytest.approx(percentile(ttft, 10))  # not 0 ms
    assert row.input_tokens_mean == pytest.approx(1000.0)


def test_a_point_where_every_request_failed_has_no_latency(tmp_path: Path) -> None:
    records = [_record(2, 0.0, ok=False), _record(3, 0.0, ok=False)]
    write_point(tmp_path, "off", 1000, PointResult(records, duration_s=1.0), metrics={})
    (row,) = summarize_result(load_result(tmp_path)).rows
    assert row.requests == 2 and row.errors == 2 and row.ttft_n == 0
    for value in (row.ttft_mean, row.ttft_median, row.ttft_p10, row.ttft_p90):
        assert math.isnan(value)  # NaN: no latency was measured, and 0 ms would be a lie
