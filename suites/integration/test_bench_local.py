"""A tiny OFF/ON sweep through LocalTopology (emulated 1P1D + router as processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bidir_kv.bench.results import load_result
from bidir_kv.bench.stats import VLLM_FIELDS
from bidir_kv.bench.summary import ratio_rows, summarize_result
from bidir_kv.client import scrape
from bidir_kv.paths import REPO_ROOT
from bidir_kv.report.cli import main as report_main
from bidir_kv.testing.poll import wait_for


def bench_argv(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bidir_kv",
        "bench",
        "--topology",
        "emulator",
        "--profile",
        "tiny",
        "--transport",
        "tcp",
        "--num-conversations",
        "2",
        "--input-tokens",
        "24",
        "--output-tokens",
        "6",
        "--no-progress",
        "-o",
        str(out),
        *extra,
    ]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def started_pids(manifest: dict) -> list[int]:
    return [
        n["pid"] for leg in manifest.get("nodes", {}).values() for n in leg.values() if n.get("pid")
    ]


def test_tiny_sweep_engages_reuse_only_when_on(tmp_path: Path) -> None:
    out = tmp_path / "res"
    proc = subprocess.run(
        bench_argv(out, "--prefix-tokens", "64,600", "--num-turns", "3", "--no-client-check"),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True
    pids = started_pids(manifest)
    assert len(pids) == 6  # P, D, router per leg
    assert not any(pid_alive(p) for p in pids)
    result = load_result(out)
    assert result.legs == ["off", "on"] and result.prefix_points == [64, 600]
    raw = json.loads((out / "on" / "p000600.stats.json").read_text())
    assert len(raw) == 6 and all(set(VLLM_FIELDS) <= set(r) for r in raw)
    assert all(r["ok"] for r in raw)
    # exact prompt lengths via the engine's /tokenize: turn 1 = prefix + input tokens
    assert sorted({r["input_num_tokens"] for r in raw if r["turn"] == 1}) == [624]
    report = summarize_result(result)
    for point in (64, 600):
        off, on = report.get("off", point), report.get("on", point)
        assert off is not None and on is not None
        # the mechanism, not TTFT: ON pulled history from D on P, OFF never did
        assert off.tokens_external == 0 and off.xfer_count == 0
        assert on.tokens_external > 0 and on.xfer_count > 0
        assert on.tokens_local_compute < off.tokens_local_compute
        assert off.prefill_count == on.prefill_count == 6  # router histogram, all requests
    assert [r["point"] for r in ratio_rows(report)] == [64, 600]
    assert report_main([str(out)]) == 0
    assert (out / "ttft.png").is_file() and (out / "prefill.png").is_file()


def test_rewritten_history_rows_report_reused_against_reusable(tmp_path: Path) -> None:
    """``--history half``: each client sends back half its previous reply. Every later
    turn's record says how many of its prompt tokens D's retained turn held
    (``reusable_tokens``), the row sums them beside the tokens P pulled, and the report
    prints both; with ids and the router's block size, everything reusable is reused."""
    out = tmp_path / "half"
    argv = bench_argv(out, "--legs", "on", "--prefix-tokens", "200", "--num-turns", "3")
    argv += ["--history", "half", "--output-tokens", "40", "--no-client-check"]
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    raw = json.loads((out / "on" / "p000200.stats.json").read_text())
    assert [r["reusable_tokens"] for r in raw if r["turn"] == 1] == [0, 0]
    later = [r for r in raw if r["turn"] > 1]
    assert later and all(r["reusable_tokens"] > 0 for r in later)
    # half the reply went back: the prompt stops sharing D's tokens inside the reply,
    # after the previous prompt and before all D retained (its prompt + reply - 1)
    prev = {(r["conversation_id"], r["turn"]): r for r in raw}
    for r in later:
        before = prev[(r["conversation_id"], r["turn"] - 1)]
        held = before["prompt_tokens"] + before["output_num_tokens"] - 1
        assert before["prompt_tokens"] - 16 < r["reusable_tokens"] < held, (r, before)
    row = summarize_result(load_result(out)).get("on", 200)
    assert row is not None and row.tokens_reusable == sum(r["reusable_tokens"] for r in raw)
    assert row.tokens_external == row.tokens_reusable  # the guard cut each hit to them
    assert report_main([str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "history: previous reply sent back `half`" in report
    assert f"| {row.tokens_reusable:.0f} | 100 % |" in report


def test_demo_rewritten_leg_sets_reused_against_reusable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's rewritten-history leg: one topology, eight ``bench --url`` runs (four
    history modes, with and without ids), one table; every run knows its reusable
    tokens, and a verbatim history with ids reuses all of them."""
    from bidir_kv.report.demo import REWRITTEN, rewritten_leg

    assert rewritten_leg(tmp_path / "rw", "tcp") == 0
    table = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(table) if line.startswith("history"))
    rows = [line.split() for line in table[head + 1 : head + 1 + 2 * len(REWRITTEN)]]
    assert [(r[0], r[1]) for r in rows] == [(h, ids) for h in REWRITTEN for ids in ("yes", "no")]
    assert all(int(r[3]) > 0 for r in rows)  # reusable known for every run
    assert rows[0][2] == rows[0][3] and rows[0][4] == "100%"  # verbatim with ids
    manifests = [json.loads(m.read_text()) for m in (tmp_path / "rw").glob("*/manifest.json")]
    assert len(manifests) == 8 and all(m["complete"] for m in manifests)


def _running(proc: subprocess.Popen[str]) -> bool:
    """True while the bench runs; its output as the failure when it already ended."""
    assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
    return True


def test_ctrl_c_leaves_a_valid_partial_result(tmp_path: Path) -> None:
    out = tmp_path / "res"
    proc = subprocess.Popen(
        bench_argv(out, "--prefix-tokens", "64,128,256", "--num-turns", "40", "--legs", "on"),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        first = out / "on" / "p000064.stats.json"
        wait_for(
            lambda: _running(proc) and first.exists(),
            120,
            "the bench's first point (80 requests) written",
        )
        router = json.loads((out / "manifest.json").read_text())["nodes"]["on"]["router-0"]
        wait_for(
            lambda: scrape(router["url"]).value("bidir_kv_router_requests_total") >= 82,
            120,
            "the second point's requests flowing",
        )
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False and manifest["interrupted"] is True
    assert not any(pid_alive(p) for p in started_pids(manifest))
    result = load_result(out)  # every file present parses
    assert (("on", 64)) in result.points
    partial = result.points.get(("on", 128))
    assert partial is not None and partial[1]["interrupted"] is True
    assert 0 < len(partial[0]) < 80
    assert ("on", 256) not in result.points
    assert not list(out.rglob("*.tmp"))
    assert report_main([str(out)]) == 0
    assert "partial result" in (out / "report.md").read_text()


def test_external_url_leg_into_an_existing_result(tmp_path: Path) -> None:
    """`--url` measures a running deployment: one leg per run, metrics from --metrics-url."""
    from bidir_kv.bench.topo import LegSetup, leg_spec
    from bidir_kv.topology.local import LocalTopology

    out = tmp_path / "res"
    spec = leg_spec("on", LegSetup(transport="tcp"))
    with LocalTopology(spec, tmp_path / "nodes") as topo:
        argv = [
            sys.executable,
            "-m",
            "bidir_kv",
            "bench",
            "--url",
            topo.router_url,
            "--legs",
            "on",
            "--metrics-url",
            f"prefill={topo.prefill[0].url}",
            "--metrics-url",
            f"router={topo.router_url}",
            "--prefix-tokens",
            "300",
            "--num-conversations",
            "2",
            "--num-turns",
            "2",
            "--input-tokens",
            "20",
            "--output-tokens",
            "4",
            "--no-progress",
            "--no-client-check",
            "-o",
            str(out),
        ]
        proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["topology"] == "external" and manifest["complete"] is True
    report = summarize_result(load_result(out))
    on = report.get("on", 300)
    assert on is not None and on.requests == 4 and on.errors == 0
    assert on.tokens_external > 0 and on.prefill_count == 4
    # exact token counts came from the prefill node's /tokenize
    raw = json.loads((out / "on" / "p000300.stats.json").read_text())
    assert {r["input_num_tokens"] for r in raw if r["turn"] == 1} == {320}


def test_sigterm_stops_every_node(tmp_path: Path) -> None:
    """A timeout or CI cancel (SIGTERM) must not orphan engines or routers."""
    out = tmp_path / "res"
    proc = subprocess.Popen(
        bench_argv(out, "--prefix-tokens", "64", "--num-turns", "200", "--legs", "on"),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        manifest_path = out / "manifest.json"
        # the leg's topology is up once the manifest lists its nodes
        wait_for(
            lambda: (
                _running(proc)
                and manifest_path.exists()
                and json.loads(manifest_path.read_text()).get("nodes")
            ),
            120,
            "the leg's topology up (nodes in the manifest)",
        )
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False, output
    pids = started_pids(manifest)
    assert len(pids) == 3
    assert not any(pid_alive(p) for p in pids), output
