"""``bidir-kv bench --connector``: which legs a session runs, what each leg starts, and the
connectors' side-by-side table (synthetic result directories; no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bidir_kv.bench.cli import build_parser
from bidir_kv.bench.cli import main as bench_main
from bidir_kv.bench.compare import compared_legs, connector_points, connector_table
from bidir_kv.bench.results import load_result
from bidir_kv.bench.runner import point_name
from bidir_kv.bench.split import prefill_by_turn
from bidir_kv.bench.stats import RequestRecord, write_records
from bidir_kv.bench.summary import summarize_result
from bidir_kv.bench.sweep import _manifest, _specs
from bidir_kv.bench.topo import (
    LegError,
    LegSetup,
    _make_topology,
    leg_spec,
    parse_connectors,
    plan_legs,
)
from bidir_kv.paths import REPO_ROOT
from bidir_kv.report.cli import main as report_main

MODULE = "bidir_kv.connector"

# ---- option parsing and leg naming ------------------------------------------------


def test_default_is_stock_and_the_legs_are_unchanged() -> None:
    args = build_parser().parse_args([])
    assert args.connector == ("stock",)
    assert plan_legs(["off", "on"], args.connector, "emulator", external=False) == ["off", "on"]
    assert plan_legs(["on"], args.connector, "emulator", external=True) == ["on"]


def test_two_connectors_add_an_on_leg_named_after_the_second() -> None:
    both = parse_connectors("stock,bidir-kv")
    assert both == ("stock", "bidir-kv")
    assert plan_legs(["off", "on"], both, "vllm-cpu", False) == ["off", "on", "on+bidir-kv"]
    assert plan_legs(["on", "off"], both, "vllm-cpu", False) == ["on", "on+bidir-kv", "off"]
    # the first is the reference: ours alone runs plain off/on, reversed names stock
    assert plan_legs(["off", "on"], ("bidir-kv",), "vllm-cpu", False) == ["off", "on"]
    assert plan_legs(["on"], ("bidir-kv", "stock"), "vllm-cpu", False) == ["on", "on+stock"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("nixl", "unknown connector 'nixl'; use stock, bidir-kv"),
        ("stock,stock", "each connector once"),
        (",", "expected one or more of stock, bidir-kv"),
    ],
)
def test_bad_connector_values_are_usage_errors_naming_the_flag(value, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--connector", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --connector" in err and message in err


@pytest.mark.parametrize(
    ("features", "connectors", "topology", "external", "message"),
    [
        (["off", "on"], ("bidir-kv",), "emulator", False, "needs --topology vllm-cpu"),
        (["off", "on"], ("stock", "bidir-kv"), "emulator", False, "with --topology emulator"),
        (["on"], ("bidir-kv",), "emulator", True, "with --url"),
        (["off"], ("stock", "bidir-kv"), "vllm-cpu", False, "compares ON legs"),
        (["on", "on"], ("stock",), "vllm-cpu", False, "each leg once"),
        (["both"], ("stock",), "vllm-cpu", False, "--legs must list"),
    ],
)
def test_combinations_the_bench_cannot_run(features, connectors, topology, external, message):
    with pytest.raises(LegError, match=message):
        plan_legs(features, connectors, topology, external)


def test_emulator_with_our_connector_exits_2_before_starting_anything(
    tmp_path: Path, capsys
) -> None:
    out = tmp_path / "run"
    rc = bench_main(["--connector", "stock,bidir-kv", "--no-progress", "-o", str(out)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--connector stock,bidir-kv needs --topology vllm-cpu" in err
    assert not out.exists()  # no manifest, no leg: nothing was started


def test_legs_of_our_connector_load_it_on_p_and_d_and_differ_in_nothing_else() -> None:
    setup = LegSetup(topology="vllm-cpu", decoder_kv_blocks_ttl=120.0)
    stock, ours = leg_spec("on", setup), leg_spec("on+bidir-kv", setup)
    for spec in (stock, ours):
        assert spec.prefill.kv.bidirectional_kv_xfer and spec.decode.kv.bidirectional_kv_xfer
    assert "kv_connector_module_path" not in stock.prefill.kv.to_dict()
    assert "kv_connector_module_path" not in leg_spec("off", setup).decode.kv.to_dict()
    for espec in (ours.prefill, ours.decode):
        assert espec.kv.to_dict()["kv_connector_module_path"] == MODULE
        assert espec.kv.kv_connector == "NixlConnector"  # vLLM's config checks stay in force
    assert stock.prefill.kv.to_dict() | {"kv_connector_module_path": MODULE} == (
        ours.prefill.kv.to_dict()
    )
    assert stock.router == ours.router
    # a session whose reference is ours runs it in plain off/on
    mine = LegSetup(topology="vllm-cpu", connector="bidir-kv")
    assert leg_spec("off", mine).prefill.kv.to_dict()["kv_connector_module_path"] == MODULE
    assert "kv_connector_module_path" not in leg_spec("on+stock", mine).prefill.kv.to_dict()
    for bad in ("off+bidir-kv", "on+nixl", "both"):
        with pytest.raises(ValueError):
            leg_spec(bad, setup)


def test_our_connector_leg_puts_the_checkout_on_the_servers_path(tmp_path: Path) -> None:
    setup = LegSetup(topology="vllm-cpu", log_dir=tmp_path)
    ours = _make_topology(setup, leg_spec("on+bidir-kv", setup), "on+bidir-kv")
    stock = _make_topology(setup, leg_spec("on", setup), "on")
    assert ours.options.python_path == (REPO_ROOT,)  # type: ignore[attr-defined]
    assert stock.options.python_path == ()  # type: ignore[attr-defined]
    assert ours.options.log_dir == tmp_path / "on+bidir-kv"  # type: ignore[attr-defined]


def test_manifest_names_each_legs_connector() -> None:
    args = build_parser().parse_args(
        ["--topology", "vllm-cpu", "--connector", "stock,bidir-kv", "--prefix-tokens", "512"]
    )
    legs = ["off", "on", "on+bidir-kv"]
    m = _manifest(args, legs, _specs(args))
    assert m["legs"] == legs and m["connector"] == "stock"
    assert m["leg_connectors"] == {"off": "stock", "on": "stock", "on+bidir-kv": "bidir-kv"}
    ext = build_parser().parse_args(["--url", "http://127.0.0.1:9", "--legs", "on"])
    m = _manifest(ext, ["on"], _specs(ext))
    assert m["connector"] is None and m["leg_connectors"] == {}


# ---- P's prefill per request from the router log ------------------------------------

LOG = """\
INFO [a1] conv=cA: cache MISS
INFO [a1] Prefill done in 400ms
INFO [b1] conv=cB: cache MISS
INFO [b1] Prefill done in 410ms
INFO [a2] conv=cA: sending D's cached blocks to P (remote_request_id=x)
INFO [a2] Prefill done in 30ms
INFO [b2] conv=cB: cache MISS
INFO [b2] Prefill done in 35ms
INFO [b2] Prefill done in 90ms
INFO [h1] conv=history:0123456789abcdef: cache MISS
INFO [h1] Prefill done in 70ms
INFO conv=cA: cache HIT (age=0.1s)
"""


def test_prefill_by_turn_numbers_each_conversations_requests() -> None:
    assert prefill_by_turn(LOG) == [
        (1, 400.0),
        (1, 410.0),
        (2, 30.0),
        (2, 90.0),  # a retried P leg counts once, its last (the answer's)
        (None, 70.0),  # a history label changes every turn: no turn number
    ]


# ---- the side-by-side table from synthetic result files -----------------------------

POINT = 1024
# per leg: TTFT of turns 1..3 and P's prefill (ms) of turns 1..3, for conversations 0..3
TTFT = {"off": (200, 200, 210), "on": (200, 50, 60), "on+bidir-kv": (200, 55, 70)}
PREFILL = {"off": (150, 150, 160), "on": (150, 20, 30), "on+bidir-kv": (150, 22, 36)}


def _rec(leg: str, conv: int, turn: int, ttft: float) -> RequestRecord:
    return RequestRecord(
        ttft_ms=ttft,
        tpot_ms=2.0,
        latency_ms=ttft + 30,
        start_time_ms=float(turn),
        input_num_turns=2 * turn - 1,
        input_num_tokens=POINT + 80 * turn,
        output_num_tokens=16,
        output_num_chunks=16,
        output_num_first_chunk_tokens=1,
        approx_cached_percent=0.0,
        conversation_id=f"c{conv}",
        client_id=0,
        leg=leg,
        point=POINT,
        turn=turn,
    )


def make_session(root: Path) -> Path:
    """OFF, ON stock and ON ours at one point, as ``bench --connector stock,bidir-kv``
    writes them: stats, metrics (vLLM's P prefill histogram), router logs, manifest."""
    out = root / "session"
    manifest: dict = {
        "topology": "vllm-cpu",
        "model": "tiny",
        "complete": True,
        "legs": list(TTFT),
        "connector": "stock",
        "leg_connectors": {"off": "stock", "on": "stock", "on+bidir-kv": "bidir-kv"},
        "workload": {"num_conversations": 4, "num_turns": 3},
        "runs": {},
        "nodes": {},
    }
    for leg in TTFT:
        (out / leg).mkdir(parents=True)
        recs, log = [], []
        for turn in (1, 2, 3):
            for conv in range(4):
                # conversation c3 is one ms slower in every figure
                recs.append(_rec(leg, conv, turn, TTFT[leg][turn - 1] + (conv == 3)))
                rid = f"{leg}-{conv}-{turn}"
                log.append(f"INFO [{rid}] conv=c{conv}: cache MISS")
                log.append(f"INFO [{rid}] Prefill done in {PREFILL[leg][turn - 1] + (conv == 3)}ms")
        write_records(out / leg / f"{point_name(POINT)}.stats.json", recs)
        engine_ms = {"off": 140.0, "on": 40.0, "on+bidir-kv": 42.0}[leg]
        metrics = {
            "prefill0": [
                ["vllm:request_prefill_time_seconds_sum", {}, 12 * engine_ms / 1e3],
                ["vllm:request_prefill_time_seconds_count", {}, 12],
            ]
        }
        info = {"duration_s": 1.0, "interrupted": False, "metrics_delta": metrics}
        (out / leg / f"{point_name(POINT)}.metrics.json").write_text(json.dumps(info))
        log_path = out / "logs" / leg / "router.log"
        log_path.parent.mkdir(parents=True)
        text = "\n".join(log) + "\n"
        log_path.write_text(text)
        manifest["nodes"][leg] = {"router-0": {"role": "router", "log": str(log_path)}}
        manifest["runs"][leg] = {str(POINT): {"router_log": {"router-0": [0, len(text)]}}}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_result_orders_legs_and_knows_their_connectors(tmp_path: Path) -> None:
    result = load_result(make_session(tmp_path))
    assert result.legs == ["off", "on", "on+bidir-kv"]
    assert [result.connector_of(leg) for leg in result.legs] == ["stock", "stock", "bidir-kv"]
    assert compared_legs(summarize_result(result)) == ["on+bidir-kv"]


def test_side_by_side_figures_and_ratios(tmp_path: Path) -> None:
    (cp,) = connector_points(summarize_result(load_result(make_session(tmp_path))))
    assert cp.point == POINT
    figs = {f.leg: f for f in cp.legs}
    assert list(figs) == ["off", "on", "on+bidir-kv"]
    on, ours = figs["on"], figs["on+bidir-kv"]
    # turns 2 and 3 only (turn 1 is a miss in every leg): 8 P legs, 8 TTFTs
    assert on.prefill_n == ours.prefill_n == 8 and on.ttft_n == 8
    assert (on.prefill_median, ours.prefill_median) == (25.5, 29.5)  # (21+30)/2, (23+36)/2
    assert on.prefill_p90 == pytest.approx(30.3) and ours.prefill_p90 == pytest.approx(36.3)
    assert (on.ttft_median, ours.ttft_median) == (55.5, 63.0)
    assert on.engine_prefill_ms == pytest.approx(40.0)
    assert ours.engine_prefill_ms == pytest.approx(42.0)
    assert not on.prefill_all_turns and ours.connector == "bidir-kv"
    (r,) = cp.ratios
    assert (r.leg, r.reference) == ("on+bidir-kv", "on")
    assert r.prefill_median == pytest.approx(29.5 / 25.5)
    assert r.prefill_p90 == pytest.approx(36.3 / 30.3)
    assert r.ttft_median == pytest.approx(63 / 55.5)
    assert r.ttft_p90 == pytest.approx(ours.ttft_p90 / on.ttft_p90)
    # with every turn (min_turn 1) turn 1's 150 ms joins both legs
    (all_turns,) = connector_points(
        summarize_result(load_result(make_session(tmp_path / "b")), min_turn=1)
    )
    assert all(f.prefill_n == 12 for f in all_turns.legs)


def test_report_prints_the_table_and_writes_the_section(tmp_path: Path, capsys) -> None:
    res = make_session(tmp_path)
    assert report_main([str(res), "--no-plots"]) == 0  # plots: test_bench_report.py
    out = capsys.readouterr().out
    assert "ratio = leg / on (stock)" in out
    assert "on+bidir-kv/on" in out and "1.157×" in out  # P prefill median 29.5 / 25.5
    md = (res / "report.md").read_text()
    section = md.split("## Connectors side by side")[1].split("\n## ")[0]
    assert "`on+bidir-kv` | bidir-kv | 63.0 |" in section
    assert "**`on+bidir-kv` / `on`**" in section and "**1.157×**" in section
    assert "`on+bidir-kv` bidir-kv" in md  # the run lines name each leg's connector


def test_one_connector_has_no_comparison(tmp_path: Path) -> None:
    res = make_session(tmp_path)
    for path in (res / "on+bidir-kv").iterdir():
        path.unlink()
    (res / "on+bidir-kv").rmdir()
    summary = summarize_result(load_result(res))
    assert connector_points(summary) == [] and connector_table(summary) == ""
    assert report_main([str(res), "--no-plots"]) == 0
    assert "Connectors side by side" not in (res / "report.md").read_text()
