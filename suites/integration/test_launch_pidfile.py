"""A node started in the background and stopped by its pidfile (bidir_kv/launch/pidfile.py,
what `bidir-kv serve` and `serve stop` run): the record it writes, a start refused over a
running node, a node that dies or never gets healthy reported with its log, a stop by
SIGTERM then SIGKILL, and never a signal to a process that only has the recorded PID.

The node is a small Python HTTP server with a ``/health`` route, started for real; the
`bidir-kv serve` command line around these is in test_serve_launch.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bidir_kv.launch.pidfile import launch, read_record, stop, stop_all
from bidir_kv.launch.process import ProcessFailed, free_port, process_running
from bidir_kv.testing.poll import wait_for

_NODE = """
import http.server, os, signal, sys
if os.environ.get("IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("node up on", sys.argv[1], flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@dataclass(frozen=True)
class _Cmd:
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


def _node(port: int, **env: str) -> _Cmd:
    return _Cmd((sys.executable, "-c", _NODE, str(port)), env)


def _start_ticks(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "run"
    yield d
    stop_all(d, timeout=5)  # whatever a failing test left running


def test_a_node_starts_healthy_with_its_record_and_stops(run: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    pidfile = run / "prefill.pid"
    record = launch(
        _node(port, NODE_ROLE="p"),
        role="prefill",
        url=url,
        log_path=run / "prefill.log",
        pidfile=pidfile,
        health_timeout=60,
    )
    assert process_running(record.pid) and record.start_ticks == _start_ticks(record.pid)
    assert (record.role, record.url, record.log) == ("prefill", url, str(run / "prefill.log"))
    assert record.argv == _node(port).argv
    assert read_record(pidfile) == record
    assert json.loads(pidfile.read_text())["pid"] == record.pid
    assert not pidfile.with_suffix(".tmp").exists()
    with pytest.raises(ProcessFailed) as again:
        launch(
            _node(port),
            role="prefill",
            url=url,
            log_path=run / "prefill.log",
            pidfile=pidfile,
            health_timeout=5,
        )
    assert str(again.value) == (
        f"{pidfile} names a running node (pid {record.pid}, {url}); run `bidir-kv serve stop` first"
    )
    assert stop(pidfile, timeout=10) == f"prefill (pid {record.pid}, {url}) stopped"
    assert not process_running(record.pid) and not pidfile.exists()
    assert stop(pidfile) == f"{pidfile}: no such pidfile"
    assert "node up on" in (run / "prefill.log").read_text()


def test_a_node_that_ignores_sigterm_is_killed(run: Path) -> None:
    port = free_port()
    pidfile = run / "decode.pid"
    record = launch(
        _node(port, IGNORE_TERM="1"),
        role="decode",
        url=f"http://127.0.0.1:{port}",
        log_path=run / "decode.log",
        pidfile=pidfile,
        health_timeout=60,
    )
    assert stop(pidfile, timeout=0.5) == (
        f"decode (pid {record.pid}, http://127.0.0.1:{port}) killed (SIGKILL)"
    )
    wait_for(lambda: not process_running(record.pid), timeout=10, what="the killed node gone")


def test_a_node_that_dies_is_stopped_and_reported_with_its_log(run: Path) -> None:
    port = free_port()
    pidfile = run / "prefill.pid"
    dies = _Cmd((sys.executable, "-c", "print('bad flag --x'); raise SystemExit(3)"))
    with pytest.raises(ProcessFailed) as failed:
        launch(
            dies,
            role="prefill",
            url=f"http://127.0.0.1:{port}/",
            log_path=run / "prefill.log",
            pidfile=pidfile,
            health_timeout=60,
        )
    text = str(failed.value)
    assert "prefill exited with code 3" in text
    assert f"--- last 1 lines of {run / 'prefill.log'} ---\nbad flag --x" in text
    assert not pidfile.exists()


def test_a_recycled_pid_is_never_signalled_and_a_stale_pidfile_is_replaced(run: Path) -> None:
    """The pidfile names a PID now held by another process (its start time differs)."""
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        run.mkdir(parents=True)
        pidfile = run / "decode.pid"
        stale = {
            "pid": other.pid,
            "start_ticks": _start_ticks(other.pid) - 1,
            "role": "decode",
            "url": "http://127.0.0.1:1",
            "log": str(run / "decode.log"),
            "argv": ["vllm", "serve"],
        }
        pidfile.write_text(json.dumps(stale))
        assert stop(pidfile) == (f"decode (pid {other.pid}) was not running; removed {pidfile}")
        assert other.poll() is None and not pidfile.exists()
        pidfile.write_text(json.dumps(stale))
        port = free_port()
        record = launch(  # a start over the stale pidfile is not refused
            _node(port),
            role="decode",
            url=f"http://127.0.0.1:{port}",
            log_path=run / "decode.log",
            pidfile=pidfile,
            health_timeout=60,
            wait=False,
        )
        assert record.pid != other.pid and read_record(pidfile) == record
        assert stop_all(run, timeout=10) == [
            f"decode (pid {record.pid}, http://127.0.0.1:{port}) stopped"
        ]
        assert other.poll() is None
    finally:
        os.killpg(other.pid, 9)
        other.wait(10)
