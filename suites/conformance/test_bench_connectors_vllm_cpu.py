"""``bidir-kv bench --topology vllm-cpu --connector bidir-kv`` against real vLLM on CPU.

A session's ON leg with our connector; a Ctrl-C once its servers answer must leave a
readable partial result and none of its servers (P, D, the router) running, and P and D
must have loaded our connector. Only the leg that is interrupted runs: a stock leg
before it would start and stop a pair of its own (about a minute) that proves nothing
about the interrupt; that stock legs load vLLM's own connector is
suites/unit/test_bench_connectors.py's, and that a completed vllm-cpu session stops its
legs' servers is checked by test_calibration_vllm_cpu.py. Timings are not asserted
(docs/connector.md "What the connector costs" has a measured session).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bidir_kv.launch.process import process_running
from bidir_kv.paths import REPO_ROOT
from bidir_kv.testing.gating import skip_or_fail

pytestmark = pytest.mark.vllm_cpu_bidir_kv  # starts real vLLM itself (docs/testing.md §1)

POINT = 512


def _manifest(out: Path) -> dict:
    try:
        return json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def _listening(url: str) -> bool:
    host, port = url.split("//")[1].split(":")
    try:
        with socket.create_connection((host, int(port.split("/")[0])), timeout=1.0):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_ctrl_c_in_our_connectors_leg_stops_every_node(tmp_path: Path, request) -> None:
    from bidir_kv.topology.vllm_cpu import unavailable_reason

    reason = unavailable_reason()
    if reason:
        skip_or_fail(request.config, "conformance", reason)
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "bidir_kv",
        "bench",
        "--topology",
        "vllm-cpu",
        "--connector",
        "bidir-kv",
        "--legs",
        "on",
        "--prefix-tokens",
        str(POINT),
        "--num-conversations",
        "2",
        "--num-turns",
        "2",
        "--input-tokens",
        "32",
        "--output-tokens",
        "4",
        "-p",
        "1",
        "--no-progress",
        "--no-client-check",
        "-o",
        str(out),
    ]
    log = (tmp_path / "bench.log").open("w")
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        # the leg's servers (P, D and the router) answer /health
        while "on" not in (_manifest(out).get("nodes") or {}):
            assert proc.poll() is None, (tmp_path / "bench.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the leg never started"
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "bench.log").read_text()
    assert rc == 130, text[-3000:]
    m = _manifest(out)
    assert m["complete"] is False and m["interrupted"] is True
    assert m["legs"] == ["on"]
    assert m["leg_connectors"] == {"on": "bidir-kv"}
    nodes = list(m["nodes"]["on"].values())
    assert len(nodes) == 3  # P, D and the router
    assert all(n["pid"] for n in nodes)  # the router's too
    assert [n["pid"] for n in nodes if process_running(int(n["pid"]))] == []
    assert [n["url"] for n in nodes if _listening(n["url"])] == []
    # P and D loaded bidir_kv.connector (its start-up line)
    logs = {n["role"]: Path(n["log"]).read_text(errors="replace") for n in nodes}
    for role in ("prefill", "decode"):
        assert "bidir-kv: " in logs[role]
