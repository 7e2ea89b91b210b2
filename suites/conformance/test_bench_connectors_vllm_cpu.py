"""``bidir-kv bench --topology vllm-cpu --connector stock,bidir-kv`` against real vLLM on CPU.

One session runs the ON leg with stock NixlConnector, then starts the ON leg with our
connector (``on+bidir-kv``); a Ctrl-C while that leg runs must leave a readable partial
result and no server of either leg running. Timings are not asserted (docs/connector.md
"What the connector costs" has a measured session).
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
from bidir_kv.testing.gating import skip_or_fail

ROOT = Path(__file__).resolve().parents[2]
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
        sys.executable, "-m", "bidir_kv", "bench", "--topology", "vllm-cpu",
        "--connector", "stock,bidir-kv", "--legs", "on", "--prefix-tokens", str(POINT),
        "--num-conversations", "2", "--num-turns", "2", "--input-tokens", "32",
        "--output-tokens", "4", "-p", "1", "--no-progress", "--no-client-check",
        "-o", str(out),
    ]  # fmt: skip
    log = (tmp_path / "bench.log").open("w")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        # the stock leg finished its point and our connector's servers answer /health
        while "on+bidir-kv" not in (_manifest(out).get("nodes") or {}):
            assert proc.poll() is None, (tmp_path / "bench.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "our connector's leg never started"
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
    assert m["legs"] == ["on", "on+bidir-kv"]
    assert m["leg_connectors"] == {"on": "stock", "on+bidir-kv": "bidir-kv"}
    stock_run = m["runs"]["on"][str(POINT)]
    assert stock_run["requests"] == 4 and stock_run["errors"] == 0, stock_run
    nodes = [n for leg in ("on", "on+bidir-kv") for n in m["nodes"][leg].values()]
    assert len(nodes) == 6  # P, D and the router of each leg
    assert all(n["pid"] for n in nodes)  # the router's too
    assert [n["pid"] for n in nodes if process_running(int(n["pid"]))] == []
    assert [n["url"] for n in nodes if _listening(n["url"])] == []
    # P and D of our leg loaded bidir_kv.connector (its start-up line); stock's did not
    logs = {leg: {n["role"]: Path(n["log"]).read_text(errors="replace")
                  for n in m["nodes"][leg].values()} for leg in ("on", "on+bidir-kv")}  # fmt: skip
    for role in ("prefill", "decode"):
        assert "bidir-kv: " in logs["on+bidir-kv"][role]
        assert "bidir-kv: " not in logs["on"][role]
