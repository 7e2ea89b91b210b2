"""The decode side of a bench result: ITL from a stream, TPOT and ITL percentiles per
(leg, point), D's memory reduced from its samples, preemptions, the tables and plot.

Why: a platform engineer who gates a release on TTFT alone can ship a TPOT
regression (issue 33); every bench, report and demo row now carries TPOT and ITL
p50/p99, D's retained share and its preemptions, OFF beside ON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.bench.memory import memory_summary
from bidir_kv.bench.results import load_result, summarize_point
from bidir_kv.bench.runner import point_name
from bidir_kv.bench.stats import RequestRecord, load_records, write_records
from bidir_kv.bench.summary import decode_rows, regression_pct, summarize_result
from bidir_kv.client import Completion
from bidir_kv.client.result import StreamReader
from bidir_kv.report.cli import decode_table, render_dir


def _chunk(text: str) -> bytes:
    return json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode()


def test_itl_is_the_gap_between_content_chunks_and_tpot_spreads_decode_over_tokens() -> None:
    out = Completion(status=200, stream=True, start=10.0)
    reader = StreamReader(out)
    reader.feed(json.dumps({"choices": [{"index": 0, "delta": {"role": "a"}}]}).encode(), 10.1)
    for t, text in ((10.5, "a"), (10.52, "b c d"), (10.60, "e"), (10.61, "")):
        reader.feed(_chunk(text), t)  # the last chunk has no content: no gap
    reader.finish(10.7)
    assert out.ttft == pytest.approx(0.5)
    assert out.itl == pytest.approx([0.02, 0.08])  # one per chunk after the first
    # a chunk carrying 3 tokens: ITL is per chunk, TPOT per token (vLLM's two numbers)
    tokens = 5
    tpot = (out.elapsed - out.ttft) / (tokens - 1)
    assert tpot == pytest.approx(0.05)


def _rec(leg: str, turn: int, tpot: float, itl: list[float], out: int = 10) -> RequestRecord:
    return RequestRecord(
        ttft_ms=100.0,
        tpot_ms=tpot,
        latency_ms=100.0 + tpot * (out - 1),
        start_time_ms=0.0,
        input_num_turns=1,
        input_num_tokens=100,
        output_num_tokens=out,
        output_num_chunks=out,
        output_num_first_chunk_tokens=1,
        approx_cached_percent=0.0,
        conversation_id="c",
        client_id=0,
        leg=leg,
        point=1000,
        turn=turn,
        itl_ms=itl,
    )


def _samples(usage: list[float], retained: list[float | None], running: list[int]) -> Any:
    n = len(usage)
    return {
        "interval_s": 0.25,
        "failures": 0,
        "nodes": {
            "decode0": {
                "t": [i * 0.25 for i in range(n)],
                "usage": usage,
                "retained": retained,
                "running": running,
                "waiting": [0] * n,
            }
        },
    }


def test_tpot_and_itl_percentiles_use_the_measured_turns_only() -> None:
    recs = [
        _rec("on", 1, 99.0, [99.0]),  # turn 1: left out like TTFT
        *(_rec("on", 2, float(t), [float(t), float(t) + 1]) for t in range(1, 101)),
        _rec("on", 3, 500.0, [500.0], out=1),  # one token: no TPOT (vLLM leaves it out)
    ]
    info = {"metrics_delta": {"decode0": [["vllm:num_preemptions_total", {}, 3.0]]}}
    row = summarize_point("on", 1000, recs, info)
    assert row.tpot_n == 100
    assert row.tpot_p50 == pytest.approx(50.5)
    assert row.tpot_p99 == pytest.approx(99.01)  # linear interpolation, as numpy's
    assert row.itl_n == 200
    assert row.itl_p99 == pytest.approx(100.0)  # gaps 1, 2, 2, ..., 100, 100, 101
    assert row.d_preemptions == 3.0


def test_preemptions_unknown_without_a_scraped_decode_node() -> None:
    recs = [_rec("off", 2, 5.0, [5.0])]
    assert (
        summarize_point("off", 1000, recs, {"metrics_delta": {"router0": []}}).d_preemptions is None
    )
    scraped_none = {"metrics_delta": {"decode0": []}}  # scraped, nothing changed: zero
    assert summarize_point("off", 1000, recs, scraped_none).d_preemptions == 0.0
    lost = {"metrics_delta": {"decode0": None}}  # the scrape failed: unknown
    assert summarize_point("off", 1000, recs, lost).d_preemptions is None


def test_retained_share_from_the_gauge_or_from_idle_samples() -> None:
    gauge = memory_summary({"memory": _samples([0.5, 0.7, 0.9], [0.2, 0.4, 0.6], [1, 1, 1])})
    assert gauge is not None and gauge.source == "gauge"
    assert gauge.retained_mean == pytest.approx(0.4) and gauge.retained_max == 0.6
    assert gauge.usage_mean == pytest.approx(0.7) and gauge.usage_max == 0.9
    # a vLLM D exports no retained gauge: usage while nothing runs is all retained turns
    idle = memory_summary({"memory": _samples([0.3, 0.8, 0.35], [None] * 3, [0, 2, 0])})
    assert idle is not None and idle.source == "idle usage"
    assert idle.retained_mean == pytest.approx(0.325) and idle.retained_max == 0.35
    busy = memory_summary({"memory": _samples([0.8], [None], [1])})
    assert busy is not None and busy.source == "none" and math.isnan(busy.retained_mean)
    assert memory_summary({}) is None
    p_only = {"memory": {"nodes": {"prefill0": _samples([0.1], [0.0], [0])["nodes"]["decode0"]}}}
    assert memory_summary(p_only) is None


def test_regression_is_on_over_off() -> None:
    assert regression_pct(10.0, 12.5) == pytest.approx(25.0)
    assert regression_pct(10.0, 9.0) == pytest.approx(-10.0)
    assert regression_pct(None, 1.0) is None and regression_pct(0.0, 1.0) is None


def _result(root: Path) -> Path:
    out = root / "res"
    for leg, tpot, usage, retained, pre in (
        ("off", 4.0, [0.3, 0.4], [0.0, 0.0], 0.0),
        ("on", 6.0, [0.8, 1.0], [0.5, 0.7], 7.0),
    ):
        (out / leg).mkdir(parents=True)
        recs = [_rec(leg, 2, tpot + i / 10, [tpot, tpot * 2]) for i in range(10)]
        write_records(out / leg / f"{point_name(1000)}.stats.json", recs)
        info = {
            "duration_s": 1.0,
            "metrics_delta": {"decode0": [["vllm:num_preemptions_total", {}, pre]]},
            "memory": _samples(usage, retained, [1, 1]),
        }
        (out / leg / f"{point_name(1000)}.metrics.json").write_text(json.dumps(info))
    return out


def test_records_round_trip_with_their_itl(tmp_path: Path) -> None:
    path = tmp_path / "p.stats.json"
    write_records(path, [_rec("on", 2, 5.0, [1.5, 2.25])])
    assert json.loads(path.read_text())[0]["itl_ms"] == [1.5, 2.25]  # one JSON array
    assert load_records(path)[0].itl_ms == [1.5, 2.25]


def test_report_shows_the_decode_side_beside_ttft(tmp_path: Path) -> None:
    out = _result(tmp_path)
    (row,) = decode_rows(summarize_result(load_result(out)))
    assert row["tpot_p99_off"] == pytest.approx(4.891)
    assert row["tpot_p99_on"] == pytest.approx(6.891)
    assert row["tpot_p99_regression_pct"] == pytest.approx((6.891 / 4.891 - 1) * 100)
    assert row["retained_mean_on"] == pytest.approx(0.6) and row["preemptions_on"] == 7.0
    report, table = render_dir(out)
    md = report.read_text()
    assert "## Decode side" in md
    assert "| 1000 | 100 / 100 | 4.45 / 6.45 | 4.89 / 6.89 | +40.9 % |" in md
    assert "60 % / 70 %" in md and "| 0 / 7 |" in md
    assert (out / "decode.png").stat().st_size > 0
    text = decode_table(summarize_result(load_result(out)))
    assert "4.89/6.89" in text and "+40.9%" in text and "0/7" in text
    assert text in table


def test_histogram_quantile_as_prometheus_with_the_lowest_bucket_as_a_bound() -> None:
    from bidir_kv.bench.results import histogram_quantile

    def rows(counts: dict[str, float]) -> list[tuple[str, dict[str, str], float]]:
        base = "vllm:inter_token_latency_seconds_bucket"
        return [(base, {"le": le}, c) for le, c in counts.items()]

    # 100 observations: 10 below 10 ms, 80 in (10, 50] ms, 10 in (50, 100] ms
    r = rows({"0.01": 10, "0.05": 90, "0.1": 100, "+Inf": 100})
    assert histogram_quantile(r, "vllm:inter_token_latency_seconds", 0.5) == pytest.approx(0.03)
    assert histogram_quantile(r, "vllm:inter_token_latency_seconds", 0.99) == pytest.approx(0.095)
    # inside the lowest bucket: its bound, not a guess between 0 and it
    assert histogram_quantile(r, "vllm:inter_token_latency_seconds", 0.05) == 0.01
    beyond = rows({"0.01": 0, "0.1": 5, "+Inf": 10})
    assert histogram_quantile(beyond, "vllm:inter_token_latency_seconds", 0.99) == 0.1
    assert math.isnan(histogram_quantile(rows({"+Inf": 0}), "vllm:x", 0.5))


def test_a_relayed_whole_answer_is_not_read_as_a_decode(tmp_path: Path) -> None:
    out = _result(tmp_path)
    (out / "manifest.json").write_text(json.dumps({"engines": {"decode_stream": "never"}}))
    report, _ = render_dir(out, plots=False)
    assert "relayed D's answers whole" in report.read_text()


def test_a_streams_tpot_counts_tokens_that_decode_to_no_text() -> None:
    """TPOT of a token-id stream: from the first chunk carrying token ids (a token may
    decode to no text, which TTFT skips) to the end, over tokens − 1."""
    out = Completion(status=200, stream=True, start=0.0)
    reader = StreamReader(out)
    for t, text, ids in ((1.0, "", [7]), (1.1, "a", [8]), (1.2, "b", [9, 10]), (1.4, "", [11])):
        reader.feed(json.dumps({"choices": [{"text": text, "token_ids": ids}]}).encode(), t)
    reader.finish(1.5)
    assert out.ttft == pytest.approx(1.1)  # the first text, as vLLM's benchmark
    assert out.tpot == pytest.approx((1.5 - 1.0) / 4)
    assert Completion(status=200, stream=False, elapsed=1.0).tpot is None
