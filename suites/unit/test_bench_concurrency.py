"""``bench --concurrency``: which levels fit the topology, and what the sweep's report
says (where the TTFT gain stops paying for the decode cost; with P's own cache on,
where P's cache stops holding the working set and read-back starts to pay)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bidir_kv.bench.cli import build_parser
from bidir_kv.bench.concurrency import LevelLimits, level_dir, level_limits, run_concurrency
from bidir_kv.bench.runner import point_name
from bidir_kv.bench.stats import RequestRecord, write_records
from bidir_kv.bench.summary import (
    ConcurrencyRow,
    concurrency_rows,
    load_levels,
    paying_limit,
    working_set_limit,
)
from bidir_kv.report import cli as report_cli
from bidir_kv.report.cli import render_concurrency_dir
from bidir_kv.report.plots import write_concurrency_plot


def test_limits_from_d_pool_sequences_and_client() -> None:
    args = build_parser().parse_args(
        [
            "--prefix-tokens",
            "8000",
            "--num-turns",
            "4",
            "--decode-engine-arg=--kv-capacity-tokens=65536",
            "--engine-arg=--max-num-seqs=6",
        ]
    )
    # longest context: 8000 + 4 x (150 + 300) = 9800 tokens: 6 conversations fit 65536
    lim = level_limits(args, client_chunks_per_s=None)
    assert lim == LevelLimits(kv_conversations=6, max_num_seqs=6, client_streams=None)
    assert lim.reason(6) is None
    assert "6 conversations" in (lim.reason(7) or "")
    # the client at 1000 chunks/s, 2x margin, qwen3-32b-p5en's ~3.7 ms steps: 1 stream
    tight = level_limits(
        build_parser().parse_args(["--profile", "qwen3-32b-p5en"]), client_chunks_per_s=1000.0
    )
    assert tight.client_streams == 1
    assert "client" in (tight.reason(2) or "")
    # vllm-cpu and --url: nothing is known here, nothing is left out
    assert level_limits(build_parser().parse_args(["--topology", "vllm-cpu"]), 10.0) == (
        LevelLimits(None, None, None)
    )


def test_each_level_is_a_whole_run_and_too_high_ones_are_left_out(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "--concurrency",
            "4,1,1000",
            "--num-conversations",
            "2",
            "--no-client-check",
            "-o",
            str(tmp_path / "sweep"),
        ]
    )
    seen = []

    def fake_bench(sub: object) -> int:
        seen.append(
            (sub.num_clients, sub.max_active_conversations, sub.num_conversations, sub.out)  # type: ignore[attr-defined]
        )
        return 0

    assert run_concurrency(args, fake_bench) == 0
    out = tmp_path / "sweep"
    assert seen == [(1, 1, 2, level_dir(out, 1)), (4, 4, 4, level_dir(out, 4))]
    doc = json.loads((out / "concurrency.json").read_text())
    assert [x["level"] for x in doc["levels"]] == [1, 4]
    assert "1000" in doc["skipped"] and "KV pool" in doc["skipped"]["1000"]


def _rec(leg: str, turn: int, ttft: float, tpot: float) -> RequestRecord:
    return RequestRecord(
        ttft_ms=ttft,
        tpot_ms=tpot,
        latency_ms=ttft + tpot * 99,
        start_time_ms=0.0,
        input_num_turns=1,
        input_num_tokens=1000,
        output_num_tokens=100,
        output_num_chunks=100,
        output_num_first_chunk_tokens=1,
        approx_cached_percent=0.0,
        conversation_id="c",
        client_id=0,
        leg=leg,
        point=1000,
        turn=turn,
        itl_ms=[tpot],
    )


# level -> (TTFT OFF, TTFT ON, TPOT OFF, TPOT ON, P-cache tokens OFF, readback ON)
LEVELS = {
    1: (300.0, 200.0, 4.0, 4.0, 900.0, 0.0),  # P's cache holds everything: ON saves 100 ms
    4: (320.0, 210.0, 4.0, 4.5, 800.0, 100.0),  # 110 ms saved, 49.5 ms of decode lost
    16: (400.0, 300.0, 5.0, 6.5, 100.0, 800.0),  # 100 ms saved, 148.5 ms lost: no longer pays
}


def _sweep(root: Path) -> Path:
    out = root / "sweep"
    for level, (t_off, t_on, p_off, p_on, hit_off, rb_on) in LEVELS.items():
        d = level_dir(out, level)
        for leg, ttft, tpot in (("off", t_off, p_off), ("on", t_on, p_on)):
            (d / leg).mkdir(parents=True)
            write_records(d / leg / f"{point_name(1000)}.stats.json", [_rec(leg, 2, ttft, tpot)])
            hit = hit_off if leg == "off" else 0.0
            rb = rb_on if leg == "on" else 0.0
            sources = {"local_cache_hit": hit, "external_kv_transfer": rb}
            sources["local_compute"] = 1000.0 - hit - rb
            rows = [
                ["vllm:prompt_tokens_by_source_total", {"source": s}, v] for s, v in sources.items()
            ]
            info = {"duration_s": 1.0, "metrics_delta": {"prefill0": rows}}
            (d / leg / f"{point_name(1000)}.metrics.json").write_text(json.dumps(info))
        manifest = {
            "workload": {"output_tokens": 100},
            "engines": {"prefix_caching": {"prefill": True, "decode": True}},
        }
        (d / "manifest.json").write_text(json.dumps(manifest))
    levels = [{"level": lv, "dir": level_dir(out, lv).name, "exit": 0} for lv in LEVELS]
    (out / "concurrency.json").write_text(json.dumps({"levels": levels, "skipped": {}}))
    return out


def test_where_the_gain_stops_paying_and_the_working_set_spills(tmp_path: Path) -> None:
    out = _sweep(tmp_path)
    rows = concurrency_rows(load_levels(out), output_tokens=100)
    by_level = {r["level"]: r for r in rows}
    assert by_level[1]["net_saving_ms"] == pytest.approx(100.0)
    assert by_level[4]["net_saving_ms"] == pytest.approx(110.0 - 0.5 * 99)
    assert by_level[16]["net_saving_ms"] == pytest.approx(100.0 - 1.5 * 99)
    assert paying_limit(rows, 1000) == (1, 16)
    assert by_level[16]["p_cache_off"] == pytest.approx(0.1)
    assert by_level[16]["readback_on"] == pytest.approx(0.8)
    # OFF's P-cache share falls below half of level 1's at 16; read-back pays from 4 (at 1
    # ON is faster too, but read nothing back: not read-back's doing)
    assert working_set_limit(rows, 1000) == (16, 4)
    report, text = render_concurrency_dir(out, plots=False)  # plots: the next two tests
    md = report.read_text()
    assert "ON pays from 1 concurrent conversations and stops paying at 16" in md
    assert "P's cache stops holding the working set at 16" in md
    assert "| 16 | 1000 | 10 % / 90 % | 0 % / 80 % / 20 % |" in md
    assert (level_dir(out, 4) / "report.md").is_file()  # every level rendered too
    assert "-48" in text  # level 16's net saving on the console
    assert ".png" not in md and not list(out.rglob("*.png"))


def test_the_sweep_plots_every_level_and_the_levels_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Which plots a sweep's report writes (the plots themselves: the next test and
    test_bench_report.py, each drawn once)."""
    out = _sweep(tmp_path)
    drawn: list[tuple[str, Path, bool | None]] = []

    def level_plots(summary: object, out_dir: Path) -> list[Path]:
        drawn.append(("level", out_dir, None))
        (out_dir / "ttft.png").write_bytes(b"png")
        return [out_dir / "ttft.png"]

    def sweep_plot(rows: list[ConcurrencyRow], out_dir: Path, p_cache: bool) -> Path:
        assert [r["level"] for r in rows] == list(LEVELS)
        drawn.append(("sweep", out_dir, p_cache))
        (out_dir / "concurrency.png").write_bytes(b"png")
        return out_dir / "concurrency.png"

    monkeypatch.setattr(report_cli, "write_plots", level_plots)
    monkeypatch.setattr(report_cli, "write_concurrency_plot", sweep_plot)
    report, _ = render_concurrency_dir(out)
    assert drawn == [("level", level_dir(out, lv), None) for lv in LEVELS] + [
        ("sweep", out, True)  # the manifest has P's prefix cache on
    ]
    assert "![concurrency](concurrency.png)" in report.read_text()
    assert "![ttft](ttft.png)" in (level_dir(out, 16) / "report.md").read_text()


def test_the_concurrency_plot_has_a_panel_for_ps_cache(tmp_path: Path) -> None:
    rows = concurrency_rows(load_levels(_sweep(tmp_path)), output_tokens=100)
    png = write_concurrency_plot(rows, tmp_path, p_cache=True).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # four panels of 4.2 inches at 110 dpi (three without P's cache)
    assert int.from_bytes(png[16:20], "big") == round(4 * 4.2 * 110)


def test_concurrency_flag_checks(tmp_path: Path) -> None:
    from bidir_kv.bench.cli import main

    assert main(["--concurrency", "0,2", "-o", str(tmp_path / "x")]) == 2
    assert main(["--concurrency", "2", "--write-profile", str(tmp_path / "p.json")]) == 2


def test_paying_limit_when_low_levels_do_not_pay() -> None:
    """P's own cache holds a few conversations: ON pays only once it no longer does."""

    def row(level: int, net: float) -> dict:
        return {"level": level, "point": 8000, "net_saving_ms": net}

    rows = [row(1, -4.0), row(2, -8.0), row(8, 3.0), row(16, 1224.0)]
    assert paying_limit(rows, 8000) == (8, None)  # type: ignore[arg-type]
    assert paying_limit([*rows, row(32, -1.0)], 8000) == (8, 32)  # type: ignore[arg-type]
    assert paying_limit([row(1, -1.0)], 8000) == (None, None)  # type: ignore[arg-type]
