"""The baseline gate on runs pytest-benchmark itself stored: two real pytest runs save
into one ``--benchmark-storage``; the gate passes a run against itself and fails the
second run, which carries a planted regression (ON rounds 30 % slower)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bidir_kv.paths import REPO_ROOT
from bidir_kv.testing.hw_baseline import gate_baseline, load_baseline
from bidir_kv.testing.hw_gates import GateFailure, LengthResult

_INNER = """
import os

import pytest

from bidir_kv.testing.hw_gates import LengthResult

SLOWER = float(os.environ["ON_FACTOR"])


@pytest.mark.parametrize("history_tokens", [2000, 4000])
def test_off_vs_on(benchmark, history_tokens):
    res = LengthResult(history_tokens=history_tokens, prompt_tokens=history_tokens + 182)

    def one_round():
        res.off_s.append(history_tokens * 1e-4)
        res.on_s.append(history_tokens * 2e-5 * SLOWER)

    benchmark.pedantic(one_round, rounds=3, iterations=1)
    benchmark.extra_info.update(res.to_dict())
"""


def _run(tmp_path: Path, storage: Path, name: str, factor: float) -> None:
    inner = tmp_path / "test_inner.py"
    inner.write_text(_INNER)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "bidir_kv.testing.plugin",
            "-q",
            "-o",
            "addopts=",
            str(inner),
            f"--benchmark-storage={storage}",
            f"--benchmark-save={name}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        # the inner run is a plain pytest run even when this one is an xdist worker
        # (pytest-benchmark stores nothing when it sees PYTEST_XDIST_* in its environment)
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
            "ON_FACTOR": str(factor),
            "PYTHONPATH": str(REPO_ROOT),
        },
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _loaded(storage: Path, run: str, length: int) -> LengthResult:
    base = load_baseline(str(storage), run)
    summary = base.lengths[length]
    return LengthResult(
        history_tokens=length,
        prompt_tokens=0,
        off_s=[summary["speedup"] * summary["on_median"]],
        on_s=[summary["on_median"]],
    )


@pytest.mark.slow
def test_stored_runs_pass_against_themselves_and_fail_on_a_planted_regression(
    tmp_path: Path,
) -> None:
    storage = tmp_path / "benchmarks"
    _run(tmp_path, storage, "release", 1.0)
    _run(tmp_path, storage, "candidate", 1.3)
    release = load_baseline(str(storage), "release")
    assert {"model", "vllm", "nixl", "backend", "launcher", "hosts"} <= set(release.deployment)
    assert sorted(release.lengths) == [2000, 4000]
    for length in (2000, 4000):
        gate_baseline(length, _loaded(storage, "release", length), release, 10.0)
        with pytest.raises(
            GateFailure,
            match=rf"length {length}: regression beyond 10 %: "
            r"ON TTFT median rose 30.0 %; speedup fell 23.1 %",
        ):
            gate_baseline(length, _loaded(storage, "candidate", length), release, 10.0)
