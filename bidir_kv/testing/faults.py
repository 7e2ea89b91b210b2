"""Faults that prove they took effect before a test judges the system.

A fault that silently did nothing makes the test after it meaningless: a "killed"
node that had already exited, a "restart" that left the old process serving, a
"paused" server that kept running, a "cut" link that still passes, a "failed"
transfer that never failed. Every injected fault goes through one of these, which
checks that it happened (the process was running and is gone; a new process serves;
every process of the tree is stopped, and runs again afterwards; a connection across
the link fails, and passes again once restored; the failure counter rose; the node
reports the fault set) and otherwise fails the test with a message starting
``fault did not take effect``. Nothing here sleeps to synchronise: every check polls
its effect against a deadline (:mod:`bidir_kv.testing.poll`).

Processes are read from ``/proc`` (Linux; the tiers that inject these faults run there).

A test expected to fail (``xfail``, e.g. a conformance pin) whose fault did not take
effect fails instead of counting as the expected failure: it showed nothing about the
defect it pins (the hook is in :mod:`bidir_kv.testing.plugin`).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

from bidir_kv.client import NodeClient, TransportError
from bidir_kv.errors import CheckFailure
from bidir_kv.launch.process import ManagedProcess, process_running, process_state, process_tree
from bidir_kv.testing.poll import WaitTimeout, wait_for
from bidir_kv.topology.base import Node, Topology

__all__ = [
    "FAULT_NOT_APPLIED",
    "FaultNotApplied",
    "confirm_counter_rose",
    "confirm_faults",
    "confirm_logged",
    "cut_link",
    "kill_container",
    "kill_pid",
    "kill_process",
    "pause_process",
    "process_state",
    "process_tree",
    "restart_node",
    "stop_process",
]

FAULT_NOT_APPLIED = "fault did not take effect"


class FaultNotApplied(CheckFailure):
    """An injected fault did not happen; the test judged nothing (an assertion failure)."""


def _fail(what: str) -> NoReturn:
    raise FaultNotApplied(f"{FAULT_NOT_APPLIED}: {what}")


def _holds(condition: Callable[[], object], timeout: float) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` passes (False)."""
    try:
        wait_for(condition, timeout, "a fault's effect", interval=0.02)
    except WaitTimeout:
        return False
    return True


# ---- kill and stop -----------------------------------------------------------------------


def kill_process(proc: ManagedProcess, sig: int = signal.SIGKILL, timeout: float = 10.0) -> int:
    """Kill a running node as a fault; return its exit code.

    Fails when the process had not started or had already exited (the kill would
    do nothing, and the test would judge a node that was never there), and when it
    is still running ``timeout`` seconds after ``sig``.
    """
    _check_running("kill", proc)
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)  # a paused node acts on a catchable signal only then
    if not _holds(lambda: proc.returncode is not None, timeout):
        _fail(
            f"{proc.name} (pid {proc.pid}) still runs {timeout:g} s after signal "
            f"{signal.Signals(sig).name}"
        )
    code = proc.returncode
    assert code is not None
    return code


def stop_process(
    proc: ManagedProcess, timeout: float = 10.0, *, gone_within: float = 10.0
) -> int | None:
    """Stop a running node as a fault (SIGTERM, SIGKILL after ``timeout``: its ``stop``);
    return its exit code. Fails when it was not running, and when it or any process of
    its tree still runs ``gone_within`` seconds after the stop."""
    pid = _check_running("stop", proc)
    proc.stop(timeout)
    if not _holds(lambda: proc.returncode is not None and not process_tree(pid), gone_within):
        left = process_tree(pid)
        _fail(
            f"{proc.name} (pid {pid}) still runs after its stop"
            + (f" (processes left: {sorted(left)})" if left else "")
        )
    return proc.returncode


def _check_running(action: str, proc: ManagedProcess) -> int:
    if proc.pid is None:
        _fail(f"{action} of {proc.name}: it was never started")
    code = proc.returncode
    if code is not None:
        _fail(
            f"{action} of {proc.name} (pid {proc.pid}): it had already exited with code "
            f"{code}\n{proc.log_tail(10)}"
        )
    return proc.pid


def kill_pid(pid: int, name: str, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
    """Signal a process that is not ours to reap (a router's worker) as a fault: it must be
    running before, and gone (exited, reaped or a zombie) within ``timeout`` after."""
    if not process_running(pid):
        _fail(
            f"kill of {name} (pid {pid}): it was not running (state {process_state(pid) or 'gone'})"
        )
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    if not _holds(lambda: not process_running(pid), timeout):
        _fail(
            f"{name} (pid {pid}) still runs {timeout:g} s after signal {signal.Signals(sig).name}"
        )


def kill_container(topo: Any, name: str, timeout: float = 30.0) -> None:
    """SIGKILL a node of a :class:`~bidir_kv.topology.container.ContainerTopology`: it
    must be running before, and its container exited within ``timeout`` after."""
    before = topo.status(name)
    if before != "running":
        _fail(f"kill of container {name}: it was {before}, not running")
    topo.kill(name)
    if not _holds(lambda: topo.status(name) == "exited", timeout):
        _fail(f"container {name} is {topo.status(name)} {timeout:g} s after its kill")


# ---- restart -----------------------------------------------------------------------------


def restart_node(topo: Topology, node: Node, timeout: float = 60.0) -> int:
    """``topo.restart(node)`` as a fault; return the new process's pid.

    The restart took effect when the process that served before (``node.info["pid"]``)
    is gone, a new process (another pid) runs, and the node's URL answers ``/health``
    with 200 again: only the new process can be serving it.
    """
    old = node.info.get("pid")
    if old is None:
        _fail(f"restart of {node.name}: its process id is not known, so no restart can be shown")
    topo.restart(node)
    new = node.info.get("pid")
    if process_running(old):
        _fail(
            f"restart of {node.name}: the old process (pid {old}) still runs"
            + ("" if new != old else " and no new one was started")
        )
    if new is None or new == old:
        _fail(f"restart of {node.name}: no new process was started (pid {old} is gone)")
    if not process_running(new):
        _fail(
            f"restart of {node.name}: the new process (pid {new}) is not running "
            f"(state {process_state(new) or 'gone'})"
        )

    def serves() -> bool:
        try:
            with NodeClient(node.url, timeout=2) as client:
                return client.get("/health").status == 200
        except TransportError:
            return False

    if not _holds(serves, timeout):
        _fail(
            f"restart of {node.name}: the new process (pid {new}) does not answer "
            f"{node.url}/health within {timeout:g} s"
        )
    return int(new)


# ---- pause (SIGSTOP) ---------------------------------------------------------------------


@contextlib.contextmanager
def pause_process(proc: ManagedProcess, timeout: float = 10.0) -> Iterator[dict[int, str]]:
    """Stop a running node's whole process group (SIGSTOP) for the block; continue it
    (SIGCONT) after.

    Before the block runs, every process of the node's tree must be stopped (state
    ``T`` in ``/proc/PID/stat``); after SIGCONT none may be stopped any more. Yields
    the tree as it was when stopped (pid -> state).
    """
    pid = _check_running("pause", proc)
    proc.send_signal(signal.SIGSTOP)
    try:
        if not _holds(lambda: _all_stopped(pid), timeout):
            tree = process_tree(pid)
            moving = {p: s for p, s in tree.items() if s != "T"}
            _fail(
                f"pause of {proc.name} (pid {pid}): "
                + (
                    f"processes {moving} of its tree are not stopped {timeout:g} s after SIGSTOP"
                    if tree
                    else "it exited instead of stopping"
                )
            )
        yield process_tree(pid)
    finally:
        proc.send_signal(signal.SIGCONT)
        if not _holds(lambda: "T" not in process_tree(pid).values(), timeout):
            still = sorted(p for p, s in process_tree(pid).items() if s == "T")
            _fail(
                f"resume of {proc.name} (pid {pid}): processes {still} are still stopped "
                f"{timeout:g} s after SIGCONT"
            )


def _all_stopped(pid: int) -> bool:
    tree = process_tree(pid)
    return bool(tree) and all(s == "T" for s in tree.values())


# ---- link cuts ---------------------------------------------------------------------------


@contextlib.contextmanager
def cut_link(
    what: str,
    cut: Callable[[], object],
    restore: Callable[[], object],
    passes: Callable[[], bool],
    timeout: float = 15.0,
) -> Iterator[None]:
    """Cut a link for the block (``cut``), restore it after (``restore``).

    ``passes`` tries to cross the link once (e.g. opens a TCP connection through it) and
    says whether that worked. It must work before the cut, fail within ``timeout`` after
    it (before the block runs), and work again within ``timeout`` of the restore.
    """
    if not passes():
        _fail(
            f"cut of {what}: the link already drops traffic before the cut, so the cut "
            "cannot be shown"
        )
    cut()
    try:
        if not _holds(lambda: not passes(), timeout):
            _fail(f"cut of {what}: traffic still passes {timeout:g} s after the cut")
        yield
    finally:
        restore()
        if not _holds(passes, timeout):
            _fail(f"restore of {what}: traffic still drops {timeout:g} s after the restore")


# ---- what the node reports ---------------------------------------------------------------


def confirm_faults(node: str, wanted: Mapping[str, Any], reported: Mapping[str, Any]) -> None:
    """An emulator's faults as it reports them after a change: each must be as set."""
    wrong = {k: reported.get(k, "<absent>") for k, v in wanted.items() if reported.get(k) != v}
    if wrong:
        asked = {k: wanted[k] for k in wrong}
        _fail(f"{node} reports faults {wrong} after being asked for {asked}")


def confirm_counter_rose(
    what: str, read: Callable[[], float], before: float, timeout: float = 10.0
) -> float:
    """A failure counter (``read()``) must rise above ``before`` within ``timeout`` after a
    transfer-failure fault: else nothing failed and the test would judge a success path.
    Returns the new value."""
    if not _holds(lambda: read() > before, timeout):
        _fail(f"{what} stayed at {before:g} ({timeout:g} s after the fault)")
    return read()


def confirm_logged(
    what: str, log_path: str | Path, needle: str, *, since: int = 0, timeout: float = 10.0
) -> None:
    """A fault a node reports only in its log (our connector's release fault): ``needle``
    must appear in ``log_path`` after byte offset ``since`` within ``timeout``."""
    path = Path(log_path)

    def logged() -> bool:
        try:
            with path.open("rb") as fh:
                fh.seek(since)
                return needle.encode() in fh.read()
        except OSError:
            return False

    if not _holds(logged, timeout):
        _fail(f"{what}: {path.name} shows no {needle!r} within {timeout:g} s")
