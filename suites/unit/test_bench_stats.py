"""Stats records carry exactly vLLM's multi-turn benchmark field names, in its order."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bidir_kv.bench.stats import (
    VLLM_FIELDS,
    RequestRecord,
    load_records,
    percentile,
    write_records,
)

# the fields of vLLM's multi-turn benchmark --stats-json-output, in order (docs/protocol.md §10.3)
UPSTREAM = [
    "ttft_ms",
    "tpot_ms",
    "latency_ms",
    "start_time_ms",
    "input_num_turns",
    "input_num_tokens",
    "output_num_tokens",
    "output_num_chunks",
    "output_num_first_chunk_tokens",
    "approx_cached_percent",
    "conversation_id",
    "client_id",
]


def record(**kw) -> RequestRecord:
    base = dict(
        ttft_ms=10.0,
        tpot_ms=1.0,
        latency_ms=20.0,
        start_time_ms=0.0,
        input_num_turns=1,
        input_num_tokens=100,
        output_num_tokens=11,
        output_num_chunks=11,
        output_num_first_chunk_tokens=1,
        approx_cached_percent=0.0,
        conversation_id="c",
        client_id=0,
    )
    base.update(kw)
    return RequestRecord(**base)


def test_field_names_match_upstream_in_order() -> None:
    assert list(VLLM_FIELDS) == UPSTREAM
    assert list(record().to_dict())[: len(UPSTREAM)] == UPSTREAM


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    recs = [record(conversation_id=f"c{i}", ttft_ms=float(i)) for i in range(3)]
    write_records(path, recs)
    assert not list(tmp_path.glob("*.tmp"))
    raw = json.loads(path.read_text())
    assert [r["conversation_id"] for r in raw] == ["c0", "c1", "c2"]
    assert load_records(path) == recs


def test_load_rejects_records_without_vllm_fields(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"ttft_ms": 1.0}]))
    with pytest.raises(ValueError, match="lacks tpot_ms"):
        load_records(path)


def test_percentiles() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([5.0], 90) == 5.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(11)), 10) == 1.0
