"""Process trees: nodes never outlive the process that started them, even when it is
SIGKILLed, and a node's CPU is counted over its whole tree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bidir_kv.launch.process import cpu_seconds, process_running
from bidir_kv.testing.faults import pause_process
from bidir_kv.testing.poll import wait_for

SCRIPT = """
import sys, time
from bidir_kv.launch.process import ManagedProcess
p = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"],
                   sys.argv[1]).start()
print(p.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal is Linux-only")
def test_child_dies_when_the_starter_is_sigkilled(tmp_path: Path) -> None:
    starter = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "sleeper.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert starter.stdout is not None
        child = int(starter.stdout.readline())
        assert process_running(child)
        starter.send_signal(signal.SIGKILL)
        starter.wait(10)
        wait_for(
            lambda: not process_running(child),
            10,
            f"child {child} to end with its SIGKILLed starter",
            interval=0.05,
        )
    finally:
        if starter.poll() is None:
            starter.kill()


def test_a_stopped_process_ends_on_sigterm_not_after_the_timeout(tmp_path: Path) -> None:
    """A paused (SIGSTOPped) node still gets a graceful SIGTERM from ``stop``."""
    from bidir_kv.launch.process import ManagedProcess

    proc = ManagedProcess(
        "sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "sleeper.log"
    ).start()
    try:
        with pause_process(proc):  # checked: the process is stopped (state T)
            # SIGTERM ends it (-15); SIGKILL after the timeout would give -9
            assert proc.stop(timeout=60) == -signal.SIGTERM
    finally:
        proc.stop(1)


GRANDCHILD = """
import os, subprocess, sys
mine = sorted(os.sched_getaffinity(0))
theirs = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                        capture_output=True, text=True, check=True).stdout.strip()
print(mine, theirs, flush=True)
"""


def _affinities(tmp_path: Path, name: str, cpus: frozenset[int] | None) -> str:
    """What GRANDCHILD prints, run as a ManagedProcess with ``cpus``."""
    from bidir_kv.launch.process import ManagedProcess

    log = tmp_path / f"{name}.log"
    proc = ManagedProcess(name, [sys.executable, "-c", GRANDCHILD], log, cpus=cpus).start()
    try:
        wait_for(
            lambda: proc.returncode is not None, 30, f"the {name} child to finish", interval=0.05
        )
    finally:
        proc.stop(5)
    assert proc.returncode == 0, log.read_text()
    return log.read_text().strip()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_cpus_pin_the_child_and_what_it_starts(tmp_path: Path) -> None:
    """``cpus`` keeps the whole process tree on those CPUs (a vLLM server's API server,
    EngineCore and worker), not only the process we start."""
    allowed = sorted(os.sched_getaffinity(0))
    one = allowed[-1]
    assert _affinities(tmp_path, "pinned", frozenset({one})) == f"[{one}] [{one}]"
    assert _affinities(tmp_path, "free", None) == f"{allowed} {allowed}"


def test_cpu_seconds_count_the_whole_tree(tmp_path: Path) -> None:
    """A vLLM server's work runs in its EngineCore and Worker children: a node's CPU is its
    tree's. Here a shell's grandchild burns 0.3 s of CPU while the shell itself waits."""
    ready = tmp_path / "burnt"
    burn = (
        "import time, pathlib\n"
        "while time.process_time() < 0.3: pass\n"
        f"pathlib.Path({str(ready)!r}).write_text('x')\n"
        "time.sleep(60)\n"
    )
    shell = subprocess.Popen(
        ["sh", "-c", f'{sys.executable} -c "$0" & wait', burn], start_new_session=True
    )
    try:
        wait_for(ready.exists, 30, "the grandchild to burn its CPU", interval=0.05)
        tree = cpu_seconds(shell.pid)
        assert tree is not None and tree >= 0.25  # clock ticks of 10 ms round down
        own = Path(f"/proc/{shell.pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert (int(own[11]) + int(own[12])) / os.sysconf("SC_CLK_TCK") < 0.1  # the shell
    finally:
        os.killpg(shell.pid, 9)
        shell.wait()
