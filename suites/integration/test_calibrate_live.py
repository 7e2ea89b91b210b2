"""``bidir-kv calibrate`` against a running emulated pair with known costs (issue 35).

The pair runs a profile whose terms are known, behind the router, with P's prefix
cache off as the publication runs it. The command measures OFF and ON at three
lengths within its budget and must give those terms back, write a profile that
``plan`` loads, and refuse clearly what it cannot measure: a P whose own prefix cache
serves the history (nothing to pull), and a budget too small for the lengths.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.bench.results import load_result
from bidir_kv.engine.profiles import load_profile
from bidir_kv.paths import REPO_ROOT
from bidir_kv.plan.calibrate import calibrate
from bidir_kv.testing.engines import kv_config
from bidir_kv.topology.base import EngineSpec, RouterSpec, TopologySpec
from bidir_kv.topology.local import LocalTopology

KNOWN: dict[str, Any] = {
    "name": "known",
    "prefill_us_per_token": 100.0,
    "prefill_fixed_us": 15_000.0,
    "decode_us_per_step": 1000.0,
    "kv_bytes_per_token_target": 1000,
    "kv_bytes_per_token": 256,
    "num_layers": 4,
    "transfer_overhead_us": 20_000.0,
    "rail_gbytes_per_s": 0.05,
    "target_block_size": 16,
}


def _pair(tmp: Path, profile: Path, *, p_cache: bool = False) -> LocalTopology:
    spec = TopologySpec(
        prefill=EngineSpec(
            kv=kv_config("prefill"),
            enable_prefix_caching=p_cache,
            profile=str(profile),
            transport="tcp",
        ),
        decode=EngineSpec(kv=kv_config("decode"), profile=str(profile), transport="tcp"),
        routers=1,
        router=RouterSpec(cache_ttl=60),
    )
    return LocalTopology(spec, tmp / "topology")


@pytest.fixture
def known(tmp_path: Path) -> Path:
    path = tmp_path / "known.json"
    path.write_text(json.dumps(KNOWN))
    return path


def calibrate_cli(topo: LocalTopology, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable,
        "-m",
        "bidir_kv",
        "calibrate",
        "-u",
        topo.router_url,
        "--metrics-url",
        f"prefill={topo.prefill[0].url}",
        "--metrics-url",
        f"decode={topo.decode[0].url}",
        "--input-tokens",
        "24",
        "--output-tokens",
        "6",
        "-o",
        str(out),
        *extra,
    ]
    return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture
def pair(tmp_path: Path, known: Path) -> Iterator[LocalTopology]:
    with _pair(tmp_path, known) as topo:
        yield topo


def test_calibrate_gives_the_known_terms_back_within_its_budget(
    pair: LocalTopology, tmp_path: Path, known: Path
) -> None:
    out, written = tmp_path / "cal", tmp_path / "mine.json"
    t0 = time.monotonic()
    proc = calibrate_cli(
        pair,
        out,
        "--lengths",
        "256,1024,2048",
        "--conversations",
        "2",
        "--budget",
        "150",
        "--write-profile",
        str(written),
    )
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert took <= 150 + 30  # the budget bounds the measurement; the rest is start-up and fit
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tool"] == "bidir-kv calibrate" and manifest["complete"]
    assert manifest["elapsed_s"] <= 150
    # three lengths, each OFF and ON, each with its own metrics delta
    result = load_result(out)
    assert sorted(result.points) == [(leg, n) for leg in ("off", "on") for n in (256, 1024, 2048)]
    want = load_profile(str(known))
    cost = calibrate(result)  # the same fit the command ran
    assert cost.recompute_us_per_token == pytest.approx(want.prefill_us_per_token, rel=0.25)
    for tokens in (1024, 2048):
        transfer_us = cost.pull_overhead_us + tokens * cost.xfer_us_per_token
        assert transfer_us == pytest.approx(want.transfer_seconds(tokens) * 1e6, rel=0.25)
    # the profile holds every fitted term: plan predicts the measured deployment from it
    mine = load_profile(str(written))
    assert mine.prefill_us_per_token == pytest.approx(cost.recompute_us_per_token, rel=1e-3)
    assert mine.prefill_fixed_us == pytest.approx(cost.prefill_fixed_us, rel=1e-3)
    assert "measured in" in proc.stdout and str(written) in proc.stdout
    plan = subprocess.run(
        [sys.executable, "-m", "bidir_kv", "plan", "--profile", str(written), "--check", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plan.returncode == 0, plan.stderr
    assert f"The cost model against {out}" in plan.stdout


def test_calibrate_refuses_a_p_whose_own_cache_serves_the_history(
    tmp_path: Path, known: Path
) -> None:
    with _pair(tmp_path, known, p_cache=True) as topo:
        proc = calibrate_cli(
            topo, tmp_path / "cal", "--lengths", "128,256,512", "--conversations", "1"
        )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "P served the history from its own prefix cache" in proc.stderr
    assert "--no-enable-prefix-caching" in proc.stderr


def test_calibrate_stops_when_the_budget_cannot_hold_the_lengths(
    tmp_path: Path, known: Path
) -> None:
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({**KNOWN, "name": "slow", "prefill_us_per_token": 2000.0}))
    with _pair(tmp_path, slow) as topo:
        t0 = time.monotonic()
        proc = calibrate_cli(topo, tmp_path / "cal", "--lengths", "64,1024,4096", "--budget", "8")
        took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "budget of 8 s" in proc.stderr and "--lengths" in proc.stderr
    # it stopped instead of running the 4096-token phases (each ~8 s here)
    assert took < 8 + 30
