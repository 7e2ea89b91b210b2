"""``bidir-kv calibrate``'s rules below the network: what it refuses, how the budget
decides the conversations per length, and why an ON phase pulled nothing (issue 35)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bidir_kv.bench.runner import point_name
from bidir_kv.bench.stats import RequestRecord, write_records
from bidir_kv.bench.workload import WorkloadSpec
from bidir_kv.plan.live import (
    CalibrationError,
    LiveOptions,
    _Budget,
    _why_no_pulls,
    conversations_that_fit,
    main,
)

NODES = {"prefill0": "http://p", "router0": "http://r"}


def test_options_need_three_lengths_and_ps_metrics() -> None:
    with pytest.raises(CalibrationError, match="at least 3 different --lengths"):
        LiveOptions(url="http://r", nodes=NODES, lengths=(256, 256, 1024))
    with pytest.raises(CalibrationError, match="--metrics-url prefill=URL"):
        LiveOptions(url="http://r", nodes={"router0": "http://r"})
    with pytest.raises(CalibrationError, match="--budget must be > 0"):
        LiveOptions(url="http://r", nodes=NODES, budget_s=0)
    with pytest.raises(CalibrationError, match="--conversations must be >= 1"):
        LiveOptions(url="http://r", nodes=NODES, conversations=0)


def test_the_command_names_a_missing_prefill_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-u", "http://127.0.0.1:9", "-o", "/nonexistent/never"]) == 2
    assert "--metrics-url prefill=URL" in capsys.readouterr().err


def _rec(tokens: int, latency_ms: float, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        ttft_ms=latency_ms / 2,
        tpot_ms=1.0,
        latency_ms=latency_ms,
        start_time_ms=0.0,
        input_num_turns=1,
        input_num_tokens=tokens,
        output_num_tokens=4,
        output_num_chunks=4,
        output_num_first_chunk_tokens=1,
        approx_cached_percent=0.0,
        conversation_id="c",
        client_id=0,
        ok=ok,
    )


def test_the_budget_extrapolates_a_line_through_the_latencies() -> None:
    budget = _Budget(100.0)
    assert budget.per_request_s(5000) == 0.0  # nothing measured: nothing to refuse yet
    budget.records += [_rec(1000, 200.0), _rec(2000, 300.0), _rec(9999, 1e9, ok=False)]
    assert budget.per_request_s(4000) == pytest.approx(0.5)  # 0.1 s + 0.1 s per 1k tokens
    spec = WorkloadSpec(prefix_tokens=0, input_tokens=100, output_tokens=100)
    # per length: n x (turn 1 of length + 100, turn 2 of length + 300)
    want = 2 * (0.1 + 0.0001 * 3100 + 0.1 + 0.0001 * 3300)
    assert budget.phases_s([3000], 2, spec=spec) == pytest.approx(want)


def test_the_conversations_per_length_shrink_to_fit_and_stop_below_one() -> None:
    per_conv = 10.0  # seconds of every remaining phase, per conversation
    assert conversations_that_fit(lambda k: k * per_conv, 100.0, 4) == 4
    assert conversations_that_fit(lambda k: k * per_conv, 25.0, 4) == 2
    assert conversations_that_fit(lambda k: k * per_conv, 9.0, 4) is None
    assert conversations_that_fit(lambda k: 0.0, 0.0, 3) == 3


def _write(out: Path, leg: str, point: int, delta: list[list[object]]) -> None:
    d = out / leg
    d.mkdir(parents=True, exist_ok=True)
    write_records(d / f"{point_name(point)}.stats.json", [_rec(point, 10.0)])
    info = {"metrics_delta": {"prefill0": delta}}
    (d / f"{point_name(point)}.metrics.json").write_text(json.dumps(info))


def test_an_on_phase_without_pulls_says_why(tmp_path: Path) -> None:
    by_source = "vllm:prompt_tokens_by_source_total"
    hit = [[by_source, {"source": "local_cache_hit"}, 900.0]]
    _write(tmp_path / "a", "on", 256, hit)
    assert "own prefix cache (900 tokens hit" in (_why_no_pulls(tmp_path / "a") or "")
    _write(tmp_path / "b", "on", 256, [[by_source, {"source": "local_compute"}, 300.0]])
    assert "bidirectional_kv_xfer on" in (_why_no_pulls(tmp_path / "b") or "")
    pulled = [[by_source, {"source": "external_kv_transfer"}, 256.0]]
    _write(tmp_path / "c", "on", 256, pulled)
    assert _why_no_pulls(tmp_path / "c") is None
