"""Start a node's command in the background, wait for ``/health``, and stop it later by
its pidfile.

A node started by ``bidir-kv serve`` (which builds the command in
:mod:`bidir_kv.serve.command`) outlives the command (a release job starts P and
D, then runs the tier), so its identity is kept in a pidfile: the PID, the process
group and the kernel's start time of the process, so ``serve stop`` never signals a
recycled PID that now belongs to someone else.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from bidir_kv.launch.process import ProcessFailed, wait_http_ok
from bidir_kv.launch.remote import Command

__all__ = ["NodeRecord", "launch", "read_record", "stop", "stop_all"]


@dataclass(frozen=True)
class NodeRecord:
    """What a pidfile holds."""

    pid: int
    start_ticks: int | None  # field 22 of /proc/<pid>/stat: the process's start time
    role: str
    url: str
    log: str
    argv: tuple[str, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def _start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces; fields after its ')' are plain
    return int(stat.rsplit(")", 1)[1].split()[19])


def read_record(pidfile: Path) -> NodeRecord:
    data = json.loads(pidfile.read_text())
    return NodeRecord(**{**data, "argv": tuple(data["argv"])})


def _alive(record: NodeRecord) -> bool:
    """The recorded process still runs (and is the same process, not a recycled PID)."""
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    ticks = _start_ticks(record.pid)
    return record.start_ticks is None or ticks is None or ticks == record.start_ticks


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f"(no log at {path})"
    return f"--- last {len(tail)} lines of {path} ---\n" + "\n".join(tail)


def launch(
    cmd: Command,
    *,
    role: str,
    url: str,
    log_path: Path,
    pidfile: Path,
    health_timeout: float,
    base_env: Mapping[str, str] | None = None,
    wait: bool = True,
) -> NodeRecord:
    """Start ``cmd`` in its own session, logging to ``log_path``; write ``pidfile``; wait
    for ``url``/health. A node that dies or never gets healthy is stopped, its pidfile
    removed, and :class:`ProcessFailed` carries its log tail."""
    if pidfile.exists():
        old = read_record(pidfile)
        if _alive(old):
            raise ProcessFailed(
                f"{pidfile} names a running node (pid {old.pid}, {old.url}); "
                "run `bidir-kv serve stop` first"
            )
        pidfile.unlink()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    env = {**(os.environ if base_env is None else base_env), **cmd.env}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(cmd.argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    record = NodeRecord(
        pid=proc.pid,
        start_ticks=_start_ticks(proc.pid),
        role=role,
        url=url,
        log=str(log_path),
        argv=tuple(cmd.argv),
    )
    tmp = pidfile.with_suffix(".tmp")
    tmp.write_text(record.to_json())
    tmp.replace(pidfile)
    if not wait:
        return record

    def gone() -> str | None:
        code = proc.poll()
        return None if code is None else f"{role} exited with code {code}"

    try:
        wait_http_ok(url.rstrip("/") + "/health", health_timeout, gone=gone)
    except ProcessFailed as exc:
        stop(pidfile, timeout=10)
        raise ProcessFailed(f"{exc}\n{_log_tail(log_path)}") from None
    return record


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def stop(pidfile: Path, timeout: float = 30.0) -> str:
    """SIGTERM the recorded node's process group, SIGKILL after ``timeout``; remove the
    pidfile. Returns one line saying what happened."""
    if not pidfile.exists():
        return f"{pidfile}: no such pidfile"
    record = read_record(pidfile)
    if not _alive(record):
        pidfile.unlink(missing_ok=True)
        return f"{record.role} (pid {record.pid}) was not running; removed {pidfile}"
    _signal_group(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(record):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(record.pid, os.WNOHANG)  # reap it when it is our own child
        time.sleep(0.1)
    how = "stopped"
    if _alive(record):
        _signal_group(record.pid, signal.SIGKILL)
        how = "killed (SIGKILL)"
    _signal_group(record.pid, signal.SIGKILL)  # stragglers left in the group
    with contextlib.suppress(ChildProcessError):
        os.waitpid(record.pid, os.WNOHANG)
    pidfile.unlink(missing_ok=True)
    return f"{record.role} (pid {record.pid}, {record.url}) {how}"


def stop_all(run_dir: Path, timeout: float = 30.0) -> list[str]:
    """Stop every node whose pidfile is in ``run_dir``."""
    return [stop(p, timeout) for p in sorted(run_dir.glob("*.pid"))]
