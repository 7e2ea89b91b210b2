"""``bidir-kv calibrate`` against a running real vLLM pair on CPU (issue 35).

The pair runs as the publication's setup (the feature on, P's prefix cache off) behind
our router; the command must measure OFF and ON at three lengths within its budget on
real vLLM's ``vllm:nixl_*`` histograms and tokens by source, fit every term with the
published table's fit and write a profile that ``plan`` loads. Accuracy is not asserted
(timings on a shared machine are not a test): the command prints the fit against its
own run, and docs/profiles.md §6 records the check of a fresh run at another length.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bidir_kv.bench.results import load_result
from bidir_kv.bench.summary import summarize_result
from bidir_kv.bench.topo import LegSetup, node_urls, start_leg
from bidir_kv.engine.profiles import load_profile
from bidir_kv.launch.process import process_running
from bidir_kv.paths import REPO_ROOT
from bidir_kv.testing.gating import skip_or_fail

LENGTHS = (256, 1024, 2048)
BUDGET_S = 180


@pytest.mark.slow
def test_calibrate_measures_a_live_vllm_cpu_pair(tmp_path: Path, request) -> None:
    from bidir_kv.topology.vllm_cpu import unavailable_reason

    reason = unavailable_reason()
    if reason:
        skip_or_fail(request.config, "conformance", reason)
    setup = LegSetup(
        topology="vllm-cpu",
        decode_stream="never",
        router_args=("--prefill-timeout", "600"),
        log_dir=tmp_path / "logs",
    )
    out, written = tmp_path / "cal", tmp_path / "cpu.json"
    with start_leg("on", setup) as topo:
        nodes = node_urls(topo)
        pids = [n.info.get("pid") for n in topo.nodes()]
        argv = [
            sys.executable,
            "-m",
            "bidir_kv",
            "calibrate",
            "-u",
            topo.router_url,
            "--metrics-url",
            f"prefill={nodes['prefill0']}",
            "--metrics-url",
            f"decode={nodes['decode0']}",
            "--lengths",
            ",".join(map(str, LENGTHS)),
            "--conversations",
            "2",
            "--input-tokens",
            "64",
            "--output-tokens",
            "8",
            "--budget",
            str(BUDGET_S),
            "-o",
            str(out),
            "--write-profile",
            str(written),
        ]
        proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        print(proc.stdout)  # the fit against its own run, for a human (-s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [p for p in pids if p and process_running(int(p))] == []
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["elapsed_s"] <= BUDGET_S
    rows = summarize_result(load_result(out), min_turn=1)
    for length in LENGTHS:
        off, on = rows.get("off", length), rows.get("on", length)
        assert off is not None and off.prefill_count and not off.tokens_external
        # real vLLM's histograms: every second turn read D's blocks
        assert on is not None and on.xfer_count > 0 and on.tokens_external > 0
        assert on.xfer_ms_per_transfer and on.mb_per_transfer and on.descriptors_per_transfer
    mine = load_profile(str(written))
    assert mine.prefill_us_per_token > 0 and mine.kv_bytes_per_token_target > 0
    assert mine.sources and any("pull:" in s for s in mine.sources)
    plan = subprocess.run(
        [sys.executable, "-m", "bidir_kv", "plan", "--profile", str(written), "--json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["cost_model"]["recompute_us_per_token"] == pytest.approx(
        mine.prefill_us_per_token
    )
