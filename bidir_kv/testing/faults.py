"""Faults that prove they took effect before a test judges the system.

A fault that silently did nothing makes the test after it meaningless: a "killed"
node that had already exited, an emulator fault the node did not accept. Every
injected fault goes through one of these, which checks that it happened (the
process was running and is gone; the node reports the fault set) and otherwise
fails the test with a message starting ``fault did not take effect``.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

from bidir_kv.launch.process import ManagedProcess
from bidir_kv.testing.poll import WaitTimeout, wait_for

__all__ = ["FAULT_NOT_APPLIED", "confirm_faults", "kill_process"]

FAULT_NOT_APPLIED = "fault did not take effect"


def kill_process(proc: ManagedProcess, sig: int = signal.SIGKILL, timeout: float = 10.0) -> int:
    """Kill a running node as a fault; return its exit code.

    Fails when the process had not started or had already exited (the kill would
    do nothing, and the test would judge a node that was never there), and when it
    is still running ``timeout`` seconds after ``sig``.
    """
    if proc.pid is None:
        raise AssertionError(f"{FAULT_NOT_APPLIED}: kill of {proc.name}: it was never started")
    code = proc.returncode
    if code is not None:
        raise AssertionError(f"{FAULT_NOT_APPLIED}: kill of {proc.name} (pid {proc.pid}): "
                             f"it had already exited with code {code}\n{proc.log_tail(10)}")
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)  # a paused node acts on a catchable signal only then
    try:
        wait_for(lambda: proc.returncode is not None, timeout, f"{proc.name} to end")
    except WaitTimeout:
        raise AssertionError(f"{FAULT_NOT_APPLIED}: {proc.name} (pid {proc.pid}) still runs "
                             f"{timeout:g} s after signal {signal.Signals(sig).name}") from None
    code = proc.returncode
    assert code is not None
    return code


def confirm_faults(node: str, wanted: Mapping[str, Any], reported: Mapping[str, Any]) -> None:
    """An emulator's faults as it reports them after a change: each must be as set."""
    wrong = {k: reported.get(k, "<absent>") for k, v in wanted.items() if reported.get(k) != v}
    if wrong:
        asked = {k: wanted[k] for k in wrong}
        raise AssertionError(f"{FAULT_NOT_APPLIED}: {node} reports faults {wrong} after "
                             f"being asked for {asked}")
