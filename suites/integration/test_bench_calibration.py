"""bench → calibration → profile on the emulator: the loop a user closes after one real run.

The first run uses a profile with known pull terms; its calibration must give those
terms back (the emulator's transfer time is the profile's, so the fit has a known
answer), predict the run's own prefill per point, and become a profile that a
second ``bench`` (which starts ``bidir-kv engine --profile FILE``) runs with.
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
from bidir_kv.paths import REPO_ROOT
from bidir_kv.plan.calibrate import CheckRow, calibrate, check_rows

KNOWN = {
    "name": "known",
    "prefill_us_per_token": 100.0,
    "decode_us_per_step": 1000.0,
    "kv_bytes_per_token_target": 1000,
    "kv_bytes_per_token": 256,
    "num_layers": 4,
    "transfer_overhead_us": 20000.0,
    "rail_gbytes_per_s": 0.05,
    "transfer_per_descriptor_us": 10.0,
    "descriptors_per_block": 4,
    "target_block_size": 16,
}
POINTS = "256,1024,2048"


def bench(out: Path, profile: Path, *extra: str) -> None:
    argv = [
        sys.executable,
        "-m",
        "bidir_kv",
        "bench",
        "--topology",
        "emulator",
        "--profile",
        str(profile),
        "--transport",
        "tcp",
        "--num-conversations",
        "2",
        "--num-turns",
        "3",
        "--input-tokens",
        "24",
        "--output-tokens",
        "6",
        "--no-progress",
        "--no-client-check",
        "-o",
        str(out),
        *extra,
    ]
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_bench_calibration_profile_loop(tmp_path: Path) -> None:
    known_path = tmp_path / "known.json"
    known_path.write_text(json.dumps(KNOWN))
    known = load_profile(str(known_path))
    first, written = tmp_path / "first", tmp_path / "mine.json"
    bench(first, known_path, "--prefix-tokens", POINTS, "--write-profile", str(written))

    result = load_result(first)
    cost = calibrate(result)
    # two clients share one P: the fit takes their wait for each other's compute out
    # (bidir_kv.plan.contention), so the per-token cost is the profile's, not inflated
    assert cost.recompute_us_per_token == pytest.approx(known.prefill_us_per_token, rel=0.25)
    # the pull terms come back: the emulated transfer time is the profile's
    assert cost.pull_overhead_us == pytest.approx(known.transfer_overhead_us, rel=0.25)
    for tokens in (1024, 2048):
        transfer_us = cost.pull_overhead_us + tokens * (
            cost.xfer_us_per_token + cost.descriptors_per_token * cost.xfer_us_per_descriptor
        )
        assert transfer_us == pytest.approx(known.transfer_seconds(tokens) * 1e6, rel=0.25)
    # the calibration predicts its own run's prefill, OFF and ON, per point
    for row in check_rows(result, cost):
        for measured, predicted in ((row.off_ms, row.off_pred_ms), (row.on_ms, row.on_pred_ms)):
            err = CheckRow.error(measured, predicted)
            assert err is not None and abs(err) <= 0.25, row

    mine = load_profile(str(written))
    assert mine.sources and mine.tp_size == 1
    # a second run emulates the calibrated cluster: its transfers take what the first's did
    second = tmp_path / "second"
    bench(second, written, "--prefix-tokens", "2048", "--legs", "on")
    was = summarize_result(result, min_turn=1).get("on", 2048)
    now = summarize_result(load_result(second), min_turn=1).get("on", 2048)
    assert was is not None and now is not None and now.xfer_count > 0
    assert now.xfer_ms_per_transfer == pytest.approx(was.xfer_ms_per_transfer, rel=0.25)
