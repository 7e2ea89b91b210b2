"""Child processes that serve HTTP: start, wait for ``/health``, capture logs, stop.

Every process a topology starts goes through :class:`ManagedProcess`, which
kills by recorded PID (never by name) and reaps its whole process group.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from bidir_kv.client import NodeClient, TransportError
from bidir_kv.errors import TopologyError

__all__ = [
    "ManagedProcess",
    "ProcessFailed",
    "cpu_seconds",
    "free_port",
    "process_running",
    "process_state",
    "process_tree",
    "wait_http_ok",
]


def _child_setup(cpus: frozenset[int] | None) -> None:
    """In the child, before exec: die with the parent, and keep to ``cpus`` if given.
    Affinity set here is inherited by every process and thread the child starts, so a
    server's helper processes stay on its cores too (docs/vllm-cpu.md)."""
    _die_with_parent()
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM us when our parent dies.

    A test runner killed with SIGKILL runs no finalizer; without this its nodes
    (in their own sessions) would outlive it. Linux only; elsewhere a no-op.
    The signal follows the *thread* that started the child, so start nodes from a
    thread that lives as long as they should (the main thread, as every caller does).
    """
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


_GONE = ("Z", "X")  # a zombie (exited, not yet reaped) or a dead task: it runs no more


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of ``pid``, or None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold ")"
    return fields[0], int(fields[1]), int(fields[2])


def process_state(pid: int) -> str | None:
    """``pid``'s state letter in ``/proc/PID/stat`` (R, S, D, T stopped, Z zombie, ...), or
    None when no such process exists."""
    st = _stat(pid)
    return None if st is None else st[0]


def process_running(pid: int) -> bool:
    """Whether ``pid`` is a live process; a zombie (or a dead task) runs no more, though its
    parent has not reaped it yet."""
    return process_state(pid) not in (None, "Z", "X")


def _cpu_ticks(pid: int) -> int | None:
    """utime + stime + cutime + cstime of ``pid`` (its own time and that of the children it
    has reaped), in clock ticks; None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text.rsplit(")", 1)[1].split()  # fields 14-17 of proc(5), from field 3 on
    return sum(int(f) for f in fields[11:15])


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) ``pid``'s tree has used (:func:`process_tree`): each live
    process's own time plus what its reaped children used. A node is its tree: a vLLM
    server's EngineCore and Worker are children of the API server, a router's workers
    children of the router. None when ``pid`` is gone."""
    if _cpu_ticks(pid) is None:
        return None
    ticks = sum(_cpu_ticks(p) or 0 for p in process_tree(pid))
    return ticks / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> dict[int, str]:
    """Every live process of ``pid``'s tree and its state: ``pid``, its descendants and the
    members of its process group (a node started by :class:`ManagedProcess` leads its own
    group, which every signal to the node reaches); zombies left out."""
    table: dict[int, tuple[str, int, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            table[int(entry.name)] = st
    children: dict[int, list[int]] = {}
    for p, (_, parent, _) in table.items():
        children.setdefault(parent, []).append(p)
    members = {p for p, (_, _, group) in table.items() if group == pid}
    todo, seen = [pid], set()
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo += children.get(current, [])
    members |= seen
    return {p: table[p][0] for p in sorted(members) if p in table and table[p][0] not in _GONE}


class ProcessFailed(TopologyError):
    """A child died or never became healthy; the message includes its log tail."""


_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()
_LOWEST_PORT = 10_000
# Picks lie this far apart: a node's side channel serves TP rank r on base + r (vLLM).
_STRIDE = 16


def _ephemeral_range() -> tuple[int, int]:
    """The OS's range for outgoing connections' source ports (Linux; a default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    """Whether ``port`` can be listened on now (no SO_REUSEADDR: a TIME_WAIT counts as busy)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port for a child process to listen on, picked so that two picks cannot collide.

    A port the OS hands out for ``bind(0)`` is free only until the socket closes: the
    next ``bind(0)`` may return it again (two ports of one node were once equal), and any
    outgoing connection may take it as its source port before the child binds. So picks
    come from below the OS's ephemeral range, ``_STRIDE`` apart, never repeat within this
    process, start at a per-process offset (two test runs side by side walk different
    ports), and must be bindable without SO_REUSEADDR at the time of the pick.
    """
    low = _LOWEST_PORT
    high = _ephemeral_range()[0] - 1
    if high - low < 1000:  # an unusual ephemeral range: let the OS pick
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    span = high - low + 1
    start = (os.getpid() * 7919) % span
    with _HANDED_OUT_LOCK:
        for i in range(span):
            port = low + (start + _STRIDE * (len(_HANDED_OUT) + i)) % span
            if port not in _HANDED_OUT and _bindable(host, port):
                _HANDED_OUT.add(port)
                return port
    raise OSError(f"no free port in {low}..{high} on {host}")


def wait_http_ok(
    url: str,
    timeout: float,
    *,
    alive: ManagedProcess | None = None,
    any_status: bool = False,
    gone: Callable[[], str | None] | None = None,
) -> None:
    """Poll ``url`` until it answers 200, the server is gone, or ``timeout`` passes.

    ``alive``: the process serving ``url`` (its exit ends the wait, with its log).
    ``gone``: any other "can it still come up?" check, returning why not (a container
    that exited). ``any_status``: any HTTP answer counts (a foreign server may have no
    health route).
    """
    deadline = time.monotonic() + timeout
    delay = 0.01
    last: object = None
    with NodeClient(url, timeout=2) as client:
        while time.monotonic() < deadline:
            if alive is not None and alive.returncode is not None:
                raise ProcessFailed(
                    f"{alive.name} exited with code {alive.returncode} before {url} was ready\n"
                    f"{alive.log_tail()}"
                )
            why = gone() if gone is not None else None
            if why is not None:
                raise ProcessFailed(f"{why} before {url} was ready")
            try:
                status = client.get("").status
            except TransportError as exc:
                last = exc
            else:
                if status == 200 or any_status:
                    return
                last = status
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)
    tail = alive.log_tail() if alive is not None else ""
    raise ProcessFailed(f"{url} not ready after {timeout:.0f} s (last: {last!r})\n{tail}")


class ManagedProcess:
    """One child process with its own process group and a log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: str | Path,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        cpus: frozenset[int] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.cpus = cpus  # the CPUs the child and everything it starts may use; None: any
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        try:
            self._proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=functools.partial(_child_setup, self.cpus),
            )
        finally:
            log.close()
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return f"(no log at {self.log_path})"
        tail = text.splitlines()[-lines:]
        return f"--- last {len(tail)} lines of {self.log_path} ---\n" + "\n".join(tail)

    def send_signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the group, then SIGKILL after ``timeout``; idempotent."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            self.send_signal(signal.SIGTERM)
            self.send_signal(signal.SIGCONT)  # a stopped (paused) group acts on it only then
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.send_signal(signal.SIGKILL)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    # SIGKILL is delivered; a starved kernel may just not have reaped it yet.
                    # Say so and let the caller go on closing the other nodes.
                    print(
                        f"{self.name} (pid {proc.pid}) not reaped 30 s after SIGKILL",
                        file=sys.stderr,
                    )
        # reap stragglers left in the group (children of the child)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.returncode
