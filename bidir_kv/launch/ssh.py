"""The ``ssh`` launcher: a node started on another host through the OpenSSH client.

``SshLauncher(SshHost("10.0.0.2", user="ubuntu"), run_dir="/tmp/bidir-kv").start(cmd,
name="decode")`` runs, in one ``ssh`` call, a small POSIX shell script on the host that

* refuses when the node's pidfile names a process that still runs (stop it first);
* starts ``env K=V … argv`` detached (``nohup setsid``: its own session and process group,
  no terminal, stdin from /dev/null, stdout and stderr to ``<run_dir>/<name>.log``);
* writes ``<run_dir>/<name>.pid``: the PID and the kernel's start time of the process
  (field 22 of ``/proc/<pid>/stat``), so a stop never signals a recycled PID.

:meth:`SshNode.stop` signals the recorded process group (TERM, KILL after the timeout)
and removes the pidfile; :meth:`SshNode.fetch_log` copies the log back. OpenSSH reports
a host it cannot reach and a login the server refuses on stderr with exit status 255;
that line becomes the one-line :class:`LaunchFailed`, and nothing was started.
The client's own options (identity, known hosts, batch mode, timeouts) come from the
caller (``options``, e.g. ``("-F", "ssh_config")``) or the user's ``~/.ssh/config``.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bidir_kv.launch.process import ProcessFailed, wait_http_ok
from bidir_kv.launch.remote import Command, LaunchFailed, one_line

__all__ = ["SshHost", "SshLauncher", "SshNode"]

_SSH_FAILED = 255  # OpenSSH's exit status for its own errors (connect, auth, config)
_RUNNING = 3  # the start script's status: the pidfile names a live node

# Shell helpers of the scripts: the start time of $pid, "" when it is gone or a zombie.
_TICKS = (
    'ticks_of() { [ -r "/proc/$1/stat" ] || return 0; '
    "sed 's/.*) //' \"/proc/$1/stat\" | awk '$1 != \"Z\" {print $20}'; }"
)


@dataclass(frozen=True)
class SshHost:
    """Where to log in: ``[user@]host``, an optional port and more ``ssh`` arguments."""

    host: str
    user: str | None = None
    port: int | None = None
    options: tuple[str, ...] = ()
    ssh: str = "ssh"

    @property
    def destination(self) -> str:
        return f"{self.user}@{self.host}" if self.user else self.host

    def argv(self, script: str) -> list[str]:
        port = ["-p", str(self.port)] if self.port else []
        return [self.ssh, *self.options, *port, "-o", "BatchMode=yes", self.destination, script]


def run_ssh(host: SshHost, script: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``script`` on ``host``; an SSH-level failure raises one-line :class:`LaunchFailed`."""
    try:
        out = subprocess.run(
            host.argv(script),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise LaunchFailed(f"ssh {host.destination}: no answer in {timeout:g} s") from None
    except OSError as exc:
        raise LaunchFailed(f"ssh {host.destination}: cannot run {host.ssh}: {exc}") from None
    if out.returncode == _SSH_FAILED:
        raise LaunchFailed(
            f"ssh {host.destination}: {one_line(out.stderr, 'ssh failed with status 255')}"
        )
    return out


def _start_script(
    run_dir: str, name: str, argv: Sequence[str], env: Mapping[str, str], cwd: str | None
) -> str:
    q = shlex.quote
    pf, log = f"{run_dir}/{name}.pid", f"{run_dir}/{name}.log"
    assign = " ".join(q(f"{k}={v}") for k, v in env.items())
    return "\n".join(
        [
            "set -e",
            _TICKS,
            f"mkdir -p {q(run_dir)}",
            f"PF={q(pf)}; LOG={q(log)}",
            'if [ -f "$PF" ]; then',
            '  read -r pid ticks < "$PF" || true',
            '  if [ -n "$pid" ] && [ -n "$(ticks_of "$pid")" ] && '
            '[ "$(ticks_of "$pid")" = "$ticks" ]; then',
            f'    echo "pidfile $PF names a running node (pid $pid)" >&2; exit {_RUNNING}',
            "  fi",
            '  rm -f "$PF"',
            "fi",
            f"cd {q(cwd)}" if cwd else "cd /",
            f'nohup setsid env {assign} {shlex.join(argv)} > "$LOG" 2>&1 < /dev/null &',
            "pid=$!",
            'echo "$pid $(ticks_of "$pid")" > "$PF.tmp"; mv "$PF.tmp" "$PF"',
            'echo "$pid"',
        ]
    )


def _stop_script(pidfile: str, timeout: float) -> str:
    steps = max(int(timeout * 10), 1)
    return "\n".join(
        [
            _TICKS,
            f"PF={shlex.quote(pidfile)}",
            'if [ ! -f "$PF" ]; then echo "no pidfile $PF"; exit 0; fi',
            'read -r pid ticks < "$PF" || true',
            'same() { [ -n "$pid" ] && [ -n "$ticks" ] && [ "$(ticks_of "$pid")" = "$ticks" ]; }',
            "if same; then",
            '  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true',
            "  i=0",
            # a bounded poll for the process to exit, on the remote host
            f'  while same && [ "$i" -lt {steps} ]; do sleep 0.1; i=$((i + 1)); done',
            '  if same; then how="killed (SIGKILL)"; else how=stopped; fi',
            '  kill -KILL -- "-$pid" 2>/dev/null || true',  # the group's stragglers
            '  echo "pid $pid $how"',
            'else echo "pid $pid was not running"; fi',
            'rm -f "$PF"',
        ]
    )


@dataclass
class SshNode:
    """A node :class:`SshLauncher` started; see the module docstring."""

    name: str
    host: SshHost
    pid: int
    pidfile: str
    log: str
    timeout: float = 60.0
    stopped: str | None = field(default=None, init=False)

    @property
    def where(self) -> str:
        return f"ssh {self.host.destination} pid {self.pid}"

    def running(self) -> bool:
        out = run_ssh(
            self.host,
            "\n".join(
                [
                    _TICKS,
                    f"read -r pid ticks < {shlex.quote(self.pidfile)} || exit 1",
                    '[ -n "$ticks" ] && [ "$(ticks_of "$pid")" = "$ticks" ]',
                ]
            ),
            self.timeout,
        )
        return out.returncode == 0

    def fetch_log(self, dest: Path) -> Path:
        out = run_ssh(self.host, f"cat {shlex.quote(self.log)}", self.timeout)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(out.stdout)
        return dest

    def stop(self, timeout: float = 30.0) -> str:
        if self.stopped is None:
            out = run_ssh(self.host, _stop_script(self.pidfile, timeout), timeout + self.timeout)
            self.stopped = f"{self.name} on {self.host.destination}: {out.stdout.strip()}"
        return self.stopped

    def wait_healthy(self, url: str, timeout: float, log_copy: Path | None = None) -> None:
        """Poll ``url`` until it answers 200; a node that exits or never gets healthy is
        stopped and :class:`LaunchFailed` carries its log tail."""
        checks = [0]

        def gone() -> str | None:
            checks[0] += 1
            if checks[0] % 8:  # one ssh round trip every few polls
                return None
            return None if self.running() else f"{self.name} on {self.host.destination} exited"

        try:
            wait_http_ok(url, timeout, gone=gone)
        except ProcessFailed as exc:
            tail = ""
            if log_copy is not None:
                self.fetch_log(log_copy)
                tail = "\n" + "\n".join(log_copy.read_text(errors="replace").splitlines()[-30:])
            self.stop(10)
            raise LaunchFailed(f"{exc}{tail}") from None


@dataclass(frozen=True)
class SshLauncher:
    """Starts commands on one host through ``ssh``; ``run_dir`` is a directory there."""

    host: SshHost
    run_dir: str = "/tmp/bidir-kv"
    timeout: float = 60.0  # seconds for one ssh call

    def start(
        self,
        cmd: Command,
        *,
        name: str,
        base_env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> SshNode:
        """Start ``cmd`` (``argv`` + ``env``, plus ``base_env`` beneath it) as ``name``."""
        env = {**(base_env or {}), **cmd.env}
        out = run_ssh(
            self.host, _start_script(self.run_dir, name, list(cmd.argv), env, cwd), self.timeout
        )
        if out.returncode != 0:
            raise LaunchFailed(
                f"ssh {self.host.destination}: starting {name} failed: "
                f"{one_line(out.stderr, f'exit status {out.returncode}')}"
            )
        try:
            pid = int(out.stdout.split()[-1])
        except (IndexError, ValueError):
            raise LaunchFailed(
                f"ssh {self.host.destination}: starting {name} printed no PID "
                f"({out.stdout.strip()!r})"
            ) from None
        return SshNode(
            name=name,
            host=self.host,
            pid=pid,
            pidfile=f"{self.run_dir}/{name}.pid",
            log=f"{self.run_dir}/{name}.log",
            timeout=self.timeout,
        )


def stop_all(
    nodes: Sequence[SshNode],
    timeout: float = 30.0,
    report: Callable[[str], None] = lambda _line: None,
) -> None:
    """Stop every node, in reverse order, each even when an earlier stop failed."""
    for node in reversed(nodes):
        try:
            report(node.stop(timeout))
        except LaunchFailed as exc:
            report(str(exc))
