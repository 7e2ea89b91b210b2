"""Report rendering and calibration from a small synthetic result directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bidir_kv.bench.results import ResultError, load_result
from bidir_kv.bench.runner import point_name
from bidir_kv.bench.stats import RequestRecord, write_records
from bidir_kv.bench.summary import ratio_rows, summarize_result
from bidir_kv.plan.calibrate import calibrate, linear_fit
from bidir_kv.report.cli import main as report_main

POINTS = (1000, 4000)


def rec(leg: str, point: int, turn: int, ttft: float, conv: str) -> RequestRecord:
    return RequestRecord(
        ttft_ms=ttft,
        tpot_ms=2.0,
        latency_ms=ttft + 60,
        # one client: its requests one after the other, never two at P at once
        start_time_ms=(int(conv[1:]) * 10 + turn) * 1000.0,
        input_num_turns=2 * turn - 1,
        input_num_tokens=point + 150 * turn,
        output_num_tokens=31,
        output_num_chunks=31,
        output_num_first_chunk_tokens=1,
        approx_cached_percent=50.0,
        conversation_id=conv,
        client_id=0,
        leg=leg,
        point=point,
        turn=turn,
    )


def make_result(root: Path) -> Path:
    """OFF recomputes (TTFT ∝ length); ON pulls (turn 1 like OFF, then fast)."""
    out = root / "res"
    for leg in ("off", "on"):
        (out / leg).mkdir(parents=True)
        for point in POINTS:
            recs = []
            for c in range(3):
                for turn in (1, 2, 3):
                    slow = point / 10 + c
                    ttft = slow if (leg == "off" or turn == 1) else point / 100 + c
                    recs.append(rec(leg, point, turn, ttft, f"c{c}"))
            write_records(out / leg / f"{point_name(point)}.stats.json", recs)
            tokens = point + 300.0
            # router prefill histogram (9 requests) and P's transfer metrics
            prefill_s = 9 * (0.0001 * tokens + 0.002) if leg == "off" else 9 * 0.004
            rows = {
                "router0": [
                    ["bidir_kv_router_prefill_duration_seconds_sum", {"outcome": "ok"}, prefill_s],
                    ["bidir_kv_router_prefill_duration_seconds_count", {"outcome": "ok"}, 9],
                ],
                "prefill0": [
                    [
                        "vllm:prompt_tokens_by_source_total",
                        {"source": "local_compute"},
                        9 * tokens if leg == "off" else 600.0,
                    ],
                ],
            }
            if leg == "on":
                pulled = 6 * point
                rows["prefill0"] += [
                    ["vllm:nixl_xfer_time_seconds_sum", {}, 6 * (0.001 + point * 2e-6)],
                    ["vllm:nixl_xfer_time_seconds_count", {}, 6],
                    ["vllm:nixl_bytes_transferred_sum", {}, pulled * 64],
                    ["vllm:nixl_bytes_transferred_count", {}, 6],
                    [
                        "vllm:prompt_tokens_by_source_total",
                        {"source": "external_kv_transfer"},
                        pulled,
                    ],
                ]
            info = {"duration_s": 1.0, "interrupted": False, "metrics_delta": rows}
            (out / leg / f"{point_name(point)}.metrics.json").write_text(json.dumps(info))
    manifest = {
        "topology": "emulator",
        "profile": "tiny",
        "model": "tiny",
        "complete": True,
        "workload": {
            "num_conversations": 3,
            "num_turns": 3,
            "input_tokens": 150,
            "output_tokens": 31,
            "think_time": "const:0",
            "seed": 0,
        },
        "num_clients": 2,
        "max_active_conversations": 3,
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_report_numbers(tmp_path: Path) -> None:
    result = load_result(make_result(tmp_path))
    assert result.legs == ["off", "on"] and result.prefix_points == list(POINTS)
    report = summarize_result(result)
    rows = {r["point"]: r for r in ratio_rows(report)}
    # turns >= 2 only: OFF median point/10 + 1, ON median point/100 + 1
    assert rows[4000]["ttft_off_ms"] == 401 and rows[4000]["ttft_on_ms"] == 41
    assert rows[4000]["ttft_ratio"] == pytest.approx(401 / 41)
    on = report.get("on", 4000)
    assert on is not None
    assert on.xfer_count == 6
    assert on.xfer_ms_per_transfer == pytest.approx(1 + 4000 * 2e-3)
    assert on.mb_per_transfer == pytest.approx(4000 * 64 / 2**20)
    assert on.prefill_ms == pytest.approx(4.0)
    assert on.tokens_external == 24000
    # turn 1 included: the OFF/ON medians become equal-ish at min_turn=1
    all_turns = summarize_result(result, min_turn=1)
    assert all_turns.get("off", 1000).ttft_n == 9


def test_report_cli_writes_markdown_and_plots(tmp_path: Path, capsys) -> None:
    res = make_result(tmp_path)
    assert report_main([str(res)]) == 0
    out = capsys.readouterr().out
    assert "OFF/ON" in out and "9.78×" in out  # 4000: medians 401 / 41
    md = (res / "report.md").read_text()
    assert "| 4000 |" in md and "![ttft](ttft.png)" in md and "![prefill](prefill.png)" in md
    assert "![decode](decode.png)" in md
    # no profile costs ("tiny" is all zeros): the prediction comes from a calibration
    assert "## Planner prediction (calibration)" in md
    assert "Calibration against its own run" in md and "| 4000 |" in md.split("own run")[1]
    assert "pulling pays from 10 history tokens" in md  # 1000 µs / (100 − 2) µs per token
    for png in ("ttft.png", "prefill.png", "decode.png"):
        assert (res / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(res / png) in out


def test_report_without_plots_writes_the_tables_only(tmp_path: Path, capsys) -> None:
    res = make_result(tmp_path)
    assert report_main([str(res), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "9.78×" in out and ".png" not in out
    md = (res / "report.md").read_text()
    assert "| 4000 |" in md and ".png" not in md
    assert not list(res.glob("*.png"))


def test_report_rejects_a_non_result(tmp_path: Path, capsys) -> None:
    with pytest.raises(ResultError):
        load_result(tmp_path)
    assert report_main([str(tmp_path / "missing")]) == 1
    assert "not a directory" in capsys.readouterr().err


def test_calibration_recovers_the_synthetic_costs(tmp_path: Path) -> None:
    cost = calibrate(load_result(make_result(tmp_path)))
    # OFF: 0.1 ms per computed token; ON: 1 ms + 2 µs per pulled token; 64 B per token
    assert cost.recompute_us_per_token == pytest.approx(100.0)
    assert cost.pull_overhead_us == pytest.approx(1000.0)
    assert cost.xfer_us_per_token == pytest.approx(2.0)
    assert cost.kv_bytes_per_token == pytest.approx(64.0)
    assert linear_fit([2.0], [4.0]) == (0.0, 2.0)
