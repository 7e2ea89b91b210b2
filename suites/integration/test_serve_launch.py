"""`bidir-kv serve` starts a node in the background, waits for /health, writes a pidfile,
and `bidir-kv serve stop` ends exactly what it started.

The node is our emulated engine behind a ``vllm`` shim (``vllm serve ARGS`` ->
``bidir-kv engine ARGS``): it takes the same flags and kv-transfer-config as vLLM, so
the command the builder makes is what a real process parses and serves with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bidir_kv.client import fetch
from bidir_kv.launch.pidfile import read_record
from bidir_kv.launch.process import free_port, process_running


def _shim(tmp_path: Path) -> Path:
    shim = tmp_path / "vllm"
    shim.write_text(
        f'#!/bin/sh\n[ "$1" = serve ] && shift\nexec {sys.executable} -m bidir_kv engine "$@"\n'
    )
    shim.chmod(0o755)
    return shim


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bidir_kv", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_serve_starts_waits_and_stop_cleans_up(tmp_path: Path) -> None:
    port, side = free_port(), free_port()
    run_dir = tmp_path / "run"
    started = _serve(
        "--role",
        "decode",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--vllm",
        str(_shim(tmp_path)),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--side-channel-port",
        str(side),
        "--decoder-kv-blocks-ttl",
        "42",
        "--run-dir",
        str(run_dir),
        "--health-timeout",
        "60",
        "--nixl-debug",
    )
    pidfile = run_dir / f"decode-{port}.pid"
    record = read_record(pidfile) if pidfile.exists() else None
    try:
        assert started.returncode == 0, started.stderr
        assert record is not None and f"http://127.0.0.1:{port}" in started.stdout
        assert fetch(f"http://127.0.0.1:{port}/health", timeout=10).status == 200
        kv = json.loads(record.argv[record.argv.index("--kv-transfer-config") + 1])
        assert kv["kv_role"] == "kv_consumer"
        assert kv["kv_connector_extra_config"]["decoder_kv_blocks_ttl"] == 42.0
        assert Path(record.log).stat().st_size > 0  # the node logs to its file
        stopped = _serve("stop", "--run-dir", str(run_dir), "--timeout", "20")
        assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout
        assert not process_running(record.pid) and not pidfile.exists()
    finally:
        if record is not None and process_running(record.pid):
            os.killpg(record.pid, 9)


def test_a_node_that_dies_is_reported_with_its_log(tmp_path: Path) -> None:
    bad = tmp_path / "vllm"
    bad.write_text("#!/bin/sh\necho 'no such model: $3' >&2\nexit 3\n")
    bad.chmod(0o755)
    out = _serve(
        "--role",
        "prefill",
        "--model",
        "missing",
        "--vllm",
        str(bad),
        "--port",
        str(free_port()),
        "--run-dir",
        str(tmp_path / "run"),
        "--health-timeout",
        "30",
    )
    assert out.returncode == 1
    assert "exited with code 3" in out.stderr and "no such model" in out.stderr
    assert not list((tmp_path / "run").glob("*.pid"))


@pytest.mark.parametrize("which", ["pidfile", "run-dir"])
def test_stop_without_a_node_says_so(tmp_path: Path, which: str) -> None:
    args = (
        ["--pidfile", str(tmp_path / "x.pid")]
        if which == "pidfile"
        else ["--run-dir", str(tmp_path)]
    )
    out = _serve("stop", *args)
    assert out.returncode == 0 and ("no such pidfile" in out.stdout or "no pidfiles" in out.stdout)
