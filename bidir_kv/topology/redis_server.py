"""A throwaway ``redis-server`` on a free loopback port, for tests and local topologies.

No persistence, no config file: everything is on the command line, and the
process is stopped by PID through :class:`ManagedProcess`.
"""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

from bidir_kv.launch.process import ManagedProcess, ProcessFailed, free_port
from bidir_kv.topology.base import BackendUnavailable

__all__ = ["RedisServer", "redis_binary"]


def redis_binary() -> str:
    """Path of ``redis-server``; :class:`BackendUnavailable` names what is missing."""
    path = shutil.which("redis-server")
    if path is None:
        raise BackendUnavailable(
            "redis-server binary not found (Debian package redis-server; "
            "ci/provision.d/redis.sh installs it)"
        )
    return path


class RedisServer:
    """``with RedisServer(log_dir) as r: r.url``; restartable on the same port."""

    def __init__(self, log_dir: str | Path, host: str = "127.0.0.1", port: int | None = None):
        self.host = host
        self.port = port or free_port(host)
        self.log_dir = Path(log_dir)
        self._proc: ManagedProcess | None = None
        self._starts = 0

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def process(self) -> ManagedProcess | None:
        """The running server's process (``None`` when stopped)."""
        return self._proc

    def start(self, timeout: float = 10.0) -> RedisServer:
        argv = [
            redis_binary(),
            "--bind",
            self.host,
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--dir",
            str(self.log_dir),
        ]
        self._starts += 1
        self._proc = ManagedProcess(
            f"redis-{self.port}", argv, self.log_dir / f"redis-{self.port}-{self._starts}.log"
        ).start()
        self._wait(timeout)
        return self

    def _wait(self, timeout: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.returncode is not None:
                raise ProcessFailed(f"redis-server exited early\n{self._proc.log_tail()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise ProcessFailed(f"redis-server not answering on {self.url}\n{self._proc.log_tail()}")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop()
            self._proc = None

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
