"""``bidir-kv proxy --workers N``: N router processes accepting on one port.

One router process is one event loop, so it uses one core. With ``--workers N`` the
parent forks N workers before any loop or connection exists; each binds its own
listening socket with ``SO_REUSEPORT`` and the kernel spreads new connections over
them. Workers share nothing but the store, which is why more than one needs Redis
(the memory store lives in one process). Each worker keeps its own ``/metrics`` (a
scrape answers for the worker it reaches).

The parent only supervises:

- **A worker that exits** (killed, crashed, or exiting on its own, whatever its code)
  is a death: the supervisor forks a replacement with the same index after a backoff
  (``RESPAWN_DELAY_S`` doubling per recent death, at most ``RESPAWN_DELAY_MAX_S``). The
  other workers are not touched: their requests in flight go on. Their listening
  sockets take the new connections meanwhile (the dead worker's backlog is lost with
  its socket).
- **Too many deaths**: more than ``max_deaths`` within ``window`` seconds means the
  workers cannot stay up (a bad store URL, a bug on every turn); the supervisor stops
  the others and exits 1, so a restart policy above it sees a failed service.
- **SIGTERM or SIGINT** to the supervisor is passed to every worker, which stops
  accepting and finishes its requests in flight (aiohttp's graceful shutdown); the
  supervisor exits 0 once all have exited. A death then is not replaced.
- ``restarts`` (shared memory, written by the supervisor) is what every worker's
  ``bidir_kv_router_worker_restarts`` reads at scrape time.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing.sharedctypes
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RESPAWN_DELAY_MAX_S", "RESPAWN_DELAY_S", "reuse_port_socket", "run_workers"]

log = logging.getLogger("bidir_kv.router")

RESPAWN_DELAY_S = 0.2  # backoff before replacing a dead worker, doubled per recent death
RESPAWN_DELAY_MAX_S = 10.0


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` that other workers may bind too."""
    family, _, _, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return socket.create_server(address, family=family, backlog=1024, reuse_port=True)


def _die_with_parent(supervisor: int) -> None:
    """Ask Linux to SIGTERM this worker when the supervisor dies (even by SIGKILL)."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != supervisor:  # the supervisor died before the call
        os._exit(1)


def _exit_status(status: int) -> int:
    return os.waitstatus_to_exitcode(status) if status else 0


@dataclass(frozen=True)
class _System:
    """The calls the supervisor makes to the OS and the clock (a unit test gives its
    own, so the supervision rules run without forking)."""

    fork: Callable[[], int] = os.fork
    wait: Callable[[], tuple[int, int]] = os.wait
    waitpid: Callable[[int, int], tuple[int, int]] = os.waitpid
    kill: Callable[[int, int], None] = os.kill
    handle: Callable[[int, Any], Any] = signal.signal
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


class _Supervisor:
    def __init__(
        self,
        count: int,
        serve: Callable[[int, Any], int],
        max_deaths: int,
        window: float,
        system: _System | None = None,
    ) -> None:
        self.os = system or _System()
        self.count = count
        self.serve = serve
        self.max_deaths = max_deaths
        self.window = window
        self.pid = os.getpid()
        self.children: dict[int, int] = {}  # pid -> worker index
        self.deaths: collections.deque[float] = collections.deque()
        self.stopping = False
        self.restarts: Any = multiprocessing.sharedctypes.RawValue("i", 0)

    def spawn(self, index: int) -> None:
        pid = self.os.fork()
        if pid == 0:  # worker: default signal handling, serve, never return here
            code = 1
            try:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                _die_with_parent(self.pid)
                code = self.serve(index, self.restarts)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.children[pid] = index

    def forward(self, signum: int, _frame: object = None) -> None:
        self.stopping = True
        for child in self.children:
            with contextlib.suppress(ProcessLookupError):
                self.os.kill(child, signum)

    def _backoff(self) -> bool:
        """Wait before a respawn; False when a stop came meanwhile."""
        delay = min(RESPAWN_DELAY_MAX_S, RESPAWN_DELAY_S * 2 ** (len(self.deaths) - 1))
        until = self.os.clock() + delay
        while not self.stopping and self.os.clock() < until:
            self.os.sleep(0.05)  # pacing; a signal handler sets ``stopping`` meanwhile
        return not self.stopping

    def run(self) -> int:
        for index in range(self.count):
            self.spawn(index)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.os.handle(sig, self.forward)
        code = 0
        try:
            while self.children:
                pid, status = self.os.wait()
                index = self.children.pop(pid, -1)
                if index < 0 or self.stopping:
                    continue
                now = self.os.clock()
                self.deaths.append(now)
                while self.deaths and self.deaths[0] < now - self.window:
                    self.deaths.popleft()
                log.warning(
                    "router worker %d (pid %d) exited with status %d",
                    index,
                    pid,
                    _exit_status(status),
                )
                if len(self.deaths) > self.max_deaths:
                    log.error(
                        "%d router workers died within %g s: stopping all of them",
                        len(self.deaths),
                        self.window,
                    )
                    code = 1
                    self.forward(signal.SIGTERM)
                    continue
                if self._backoff():
                    self.restarts.value += 1
                    self.spawn(index)
                    log.warning(
                        "router worker %d replaced (%d replacements so far)",
                        index,
                        self.restarts.value,
                    )
        finally:
            self.forward(signal.SIGTERM)
            for child in list(self.children):
                with contextlib.suppress(ChildProcessError):
                    self.os.waitpid(child, 0)
        return code


def run_workers(
    count: int, serve: Callable[[int, Any], int], *, max_deaths: int = 5, window: float = 60.0
) -> int:
    """Fork ``count`` workers running ``serve(index, restarts)`` and keep them up: 0 after
    a stop by signal, 1 after more than ``max_deaths`` deaths within ``window`` s.
    ``restarts.value`` is the number of workers replaced so far (shared memory)."""
    return _Supervisor(count, serve, max_deaths, window).run()
