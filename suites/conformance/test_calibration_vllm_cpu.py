"""bench → calibration → profile against real vLLM on CPU (docs/profiles.md §6).

Real vLLM's ``vllm:nixl_*`` histograms and our router's prefill histogram must be
enough to fit every term and to write a profile the emulator loads; the session, OFF
and ON leg each on a pair of its own, leaves none of its servers running. Accuracy is
not asserted (timings on a shared machine are not a test); ``bidir-kv plan
--calibration DIR`` prints the fit against the run for a human to judge.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bidir_kv.bench.results import load_result
from bidir_kv.bench.summary import summarize_result
from bidir_kv.engine.profiles import load_profile
from bidir_kv.launch.process import process_running
from bidir_kv.paths import REPO_ROOT
from bidir_kv.plan.calibrate import calibrate, check_rows
from bidir_kv.testing.gating import skip_or_fail

pytestmark = pytest.mark.vllm_cpu  # starts real vLLM itself (docs/testing.md §1)

POINTS = (256, 1536)


@pytest.mark.slow
def test_vllm_cpu_run_calibrates_into_a_profile(tmp_path: Path, request) -> None:
    from bidir_kv.topology.vllm_cpu import unavailable_reason

    reason = unavailable_reason()
    if reason:
        skip_or_fail(request.config, "conformance", reason)
    out, written = tmp_path / "run", tmp_path / "cpu.json"
    argv = [
        sys.executable,
        "-m",
        "bidir_kv",
        "bench",
        "--topology",
        "vllm-cpu",
        "--prefix-tokens",
        ",".join(map(str, POINTS)),
        "--num-conversations",
        "2",
        "--num-turns",
        "2",
        "--input-tokens",
        "64",
        "--output-tokens",
        "8",
        "-p",
        "1",
        "--no-progress",
        "--no-client-check",
        "-o",
        str(out),
        "--write-profile",
        str(written),
    ]
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the completed session stopped every leg's servers (P, D and the router of each)
    manifest = json.loads((out / "manifest.json").read_text())
    nodes = [n for leg in ("off", "on") for n in manifest["nodes"][leg].values()]
    assert len(nodes) == 6 and all(n["pid"] for n in nodes), manifest["nodes"]
    assert [n["pid"] for n in nodes if process_running(int(n["pid"]))] == []
    result = load_result(out)
    rows = summarize_result(result, min_turn=1)
    for point in POINTS:
        on = rows.get("on", point)
        assert on is not None and on.xfer_count > 0
        # vLLM's own NIXL histograms: time, bytes and descriptors per rank-level READ
        assert on.xfer_ms_per_transfer and on.mb_per_transfer and on.descriptors_per_transfer
    cost = calibrate(result)
    assert cost.recompute_us_per_token > 0 and cost.kv_bytes_per_token > 0
    assert cost.source == "calibration" and any("pull:" in n for n in cost.notes)
    check = check_rows(result, cost)
    for r in check:  # for a human (-s): accuracy is printed, never asserted
        print(
            f"calibration check {r.point}: OFF {r.off_ms:.1f}/{r.off_pred_ms:.1f} ms "
            f"ON {r.on_ms:.1f}/{r.on_pred_ms:.1f} ms (wait {r.off_wait_ms:.1f}/{r.on_wait_ms:.1f})"
            if r.off_ms and r.off_pred_ms and r.on_ms and r.on_pred_ms
            else f"calibration check {r.point}: incomplete"
        )
    assert [r.point for r in check] == list(POINTS)
    assert all(r.off_pred_ms and r.on_pred_ms for r in check)
    mine = load_profile(str(written))
    assert mine.prefill_us_per_token == pytest.approx(cost.recompute_us_per_token, rel=1e-3)
    assert json.loads(written.read_text())["sources"] == list(mine.sources)
