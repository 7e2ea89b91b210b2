"""The hardware options are checked when pytest starts: a contradiction is a usage
error (exit 4) before any test is collected, let alone a node started."""

from __future__ import annotations

import subprocess
import sys

from bidir_kv.paths import REPO_ROOT


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_contradiction_stops_pytest_before_collection() -> None:
    proc = _pytest("--collect-only", "-q", "--hw-launch", "suites/hardware")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "--hw-launch needs --hw-launch-model" in proc.stderr
    assert "collected" not in proc.stdout and "test_release_gate" not in proc.stdout
