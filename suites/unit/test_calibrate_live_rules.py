"""``bidir-kv calibrate``'s rules below the network: what it refuses, when the budget
allows another round, how a point sums its rounds, and why an ON phase pulled nothing
(issue 35)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bidir_kv.bench.runner import PointResult, point_name
from bidir_kv.bench.stats import RequestRecord, write_records
from bidir_kv.plan.live import (
    CalibrationError,
    LiveOptions,
    _Point,
    _why_no_pulls,
    another_round_fits,
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


def test_without_a_model_name_it_asks_p_and_says_so_when_it_cannot(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["-u", "http://127.0.0.1:9", "--metrics-url", "prefill=http://127.0.0.1:9"]
    assert main([*argv, "-o", "/nonexistent/never"]) == 2
    err = capsys.readouterr().err
    assert "cannot read the served model from http://127.0.0.1:9/v1/models" in err
    assert "give -m NAME" in err


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


def test_rounds_repeat_while_the_slowest_round_fits_the_time_left() -> None:
    assert another_round_fits(0, 0.0, 0.0)  # the first round always runs
    assert another_round_fits(2, 10.0, 25.0)
    assert not another_round_fits(2, 30.0, 25.0)


def test_a_point_sums_its_rounds_on_one_timeline() -> None:
    point = _Point()
    first = PointResult([_rec(100, 10.0)], 0.5)
    second = PointResult([_rec(100, 12.0)], 0.7)
    name = "vllm:nixl_xfer_time_seconds_sum"
    point.add(first, {"prefill0": [[name, {}, 0.25]], "decode0": None}, offset_ms=0.0)
    point.add(second, {"prefill0": [[name, {}, 0.5]], "decode0": None}, offset_ms=3000.0)
    assert [r.start_time_ms for r in point.records] == [0.0, 3000.0]
    assert point.duration_s == pytest.approx(1.2)
    assert point.delta == {"prefill0": [[name, {}, 0.75]], "decode0": None}


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
