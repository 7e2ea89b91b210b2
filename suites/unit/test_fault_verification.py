"""Injected faults check that they took effect: a kill of a process that already
exited, or an emulator that did not take the fault, fails with a clear message."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from bidir_kv.launch.process import ManagedProcess
from bidir_kv.testing.faults import FAULT_NOT_APPLIED, confirm_faults, kill_process
from bidir_kv.testing.poll import wait_for


def _proc(tmp_path: Path, name: str, code: str) -> ManagedProcess:
    return ManagedProcess(name, [sys.executable, "-c", code], tmp_path / f"{name}.log").start()


def test_killing_a_process_that_already_exited_fails_the_fault(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "gone", "print('bye')")
    try:
        wait_for(lambda: proc.returncode is not None, 10, "the node to exit by itself")
        with pytest.raises(AssertionError) as err:
            kill_process(proc)
        msg = str(err.value)
        assert msg.startswith(f"{FAULT_NOT_APPLIED}: kill of gone (pid {proc.pid})")
        assert "already exited with code 0" in msg and "bye" in msg  # the node's log tail
    finally:
        proc.stop()


def test_killing_a_running_process_is_verified_gone(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "live", "import time; time.sleep(60)")
    try:
        assert kill_process(proc) == -signal.SIGKILL
        assert proc.returncode == -signal.SIGKILL
    finally:
        proc.stop()


def test_a_kill_of_a_node_never_started_fails(tmp_path: Path) -> None:
    proc = ManagedProcess("never", [sys.executable, "-c", "pass"], tmp_path / "never.log")
    with pytest.raises(AssertionError, match=f"{FAULT_NOT_APPLIED}: kill of never"):
        kill_process(proc)


def test_an_emulator_fault_not_reported_back_fails() -> None:
    confirm_faults("d0", {"stall": True}, {"stall": True, "fail_reads": 0})
    with pytest.raises(AssertionError) as err:
        confirm_faults("d0", {"stall": True, "fail_reads": 2}, {"stall": False})
    assert str(err.value) == (f"{FAULT_NOT_APPLIED}: d0 reports faults "
                              "{'stall': False, 'fail_reads': '<absent>'} after being asked for "
                              "{'stall': True, 'fail_reads': 2}")  # fmt: skip
