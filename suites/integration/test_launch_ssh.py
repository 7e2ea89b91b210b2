"""The ``ssh`` launcher's scripts (bidir_kv/launch/ssh.py) on this host: a stop signals
only the process the launcher started, named by its PID *and* its start time, so a PID
the kernel gave to another process since is never signalled.

``ssh`` is replaced by a stand-in that runs the script it is handed with ``sh`` here
(below the unit boundary: the scripts are what is under test; the real OpenSSH client and
server are in suites/integration/test_two_hosts.py).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bidir_kv.launch.process import process_running
from bidir_kv.launch.ssh import SshHost, SshLauncher, SshNode
from bidir_kv.testing.poll import wait_for

# the last argument is the script (SshHost.argv); run it here
SHIM = '#!/bin/sh\nfor last in "$@"; do :; done\nexec sh -c "$last"\n'


@dataclass(frozen=True)
class _Cmd:
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


@pytest.fixture
def here(tmp_path: Path) -> SshHost:
    shim = tmp_path / "ssh"
    shim.write_text(SHIM)
    shim.chmod(0o755)
    return SshHost("this-host", ssh=str(shim))


def _start_time(pid: int) -> int:
    """Field 22 of /proc/PID/stat: the kernel's start time, in clock ticks."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])


def test_stop_signals_the_process_it_started(here: SshHost, tmp_path: Path) -> None:
    node = SshLauncher(here, run_dir=str(tmp_path / "run")).start(
        _Cmd(("sleep", "300")), name="decode"
    )
    try:
        pidfile = Path(node.pidfile).read_text().split()
        assert pidfile == [str(node.pid), str(_start_time(node.pid))]
        assert node.running()
    finally:
        stopped = node.stop(5)
    assert stopped == f"decode on this-host: pid {node.pid} stopped"
    wait_for(lambda: not process_running(node.pid), timeout=10, what="the node gone")
    assert not Path(node.pidfile).exists()


def test_stop_never_signals_a_recycled_pid(here: SshHost, tmp_path: Path) -> None:
    """The pidfile names a PID now held by another process (its start time differs):
    the stop leaves that process alone and only removes the stale pidfile."""
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        run = tmp_path / "run"
        run.mkdir()
        pidfile = run / "decode.pid"
        pidfile.write_text(f"{other.pid} {_start_time(other.pid) - 1}\n")
        node = SshNode("decode", here, other.pid, str(pidfile), str(run / "decode.log"))
        assert not node.running()
        assert node.stop(1) == f"decode on this-host: pid {other.pid} was not running"
        assert other.poll() is None, "the stop signalled a process it did not start"
        assert process_running(other.pid)
        assert not pidfile.exists()
        # a start over that stale pidfile is not refused: it names no node of ours
        pidfile.write_text(f"{other.pid} {_start_time(other.pid) - 1}\n")
        again = SshLauncher(here, run_dir=str(run)).start(_Cmd(("sleep", "300")), name="decode")
        assert again.stop(5) == f"decode on this-host: pid {again.pid} stopped"
        assert process_running(other.pid)
    finally:
        os.killpg(other.pid, 9)
        other.wait(10)
