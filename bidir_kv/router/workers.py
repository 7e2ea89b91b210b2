"""``bidir-kv proxy --workers N``: N router processes accepting on one port.

One router process is one event loop, so it uses one core. With ``--workers N`` the
parent forks N workers before any loop or connection exists; each binds its own
listening socket with ``SO_REUSEPORT`` and the kernel spreads new connections over
them. Workers share nothing but the store, which is why more than one needs Redis
(the memory store lives in one process). The parent only supervises: it forwards
SIGINT/SIGTERM, and when one worker exits it stops the others and exits with that
worker's status, so a supervisor sees one failing service, never a degraded one.
Each worker keeps its own ``/metrics`` (a scrape answers for the worker it reaches).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from collections.abc import Callable

__all__ = ["reuse_port_socket", "run_workers"]


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` that other workers may bind too."""
    family, _, _, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
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


def run_workers(count: int, serve: Callable[[int], int]) -> int:
    """Fork ``count`` workers running ``serve(index)``; return the first one's exit code."""
    children: list[int] = []
    supervisor = os.getpid()
    for index in range(count):
        pid = os.fork()
        if pid == 0:  # worker: default signal handling, serve, never return here
            code = 1
            try:
                _die_with_parent(supervisor)
                code = serve(index)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    code = 0
    try:
        pid, status = os.wait()
        code = _exit_status(status)
        children.remove(pid)
    finally:
        forward(signal.SIGTERM, None)
        for child in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, 0)
    return code
