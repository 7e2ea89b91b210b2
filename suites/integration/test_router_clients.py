"""Slow and abusive clients at ``bidir-kv proxy``: a connection that sends nothing or a
partial request is closed at --header-timeout, an idle kept-alive one at
--idle-timeout, one past --max-connections is answered 503, and a router out of
descriptors says so in one log line and keeps accepting once they free up.

The routers here need no engine (their /metrics answers without one): the P and D
addresses point at a port nothing listens on.
"""

from __future__ import annotations

import json
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bidir_kv.launch.process import ManagedProcess, free_port, wait_http_ok
from bidir_kv.testing.poll import wait_for
from bidir_kv.testing.router import RouterProcess, router_counter

NOWHERE = [("127.0.0.1", 9)]


@pytest.fixture
def lone_router(router_process: Callable[..., RouterProcess]) -> Callable[..., RouterProcess]:
    def start(*flags: str) -> RouterProcess:
        return router_process(NOWHERE, NOWHERE, extra=("--health-interval", "30", *flags))

    return start


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=15)


def _closed_by_server(sock: socket.socket) -> bool:
    """True once the router closes ``sock`` (recv sees EOF or a reset within its timeout)."""
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def test_silent_and_partial_connections_are_closed_at_the_header_timeout(
    lone_router: Callable[..., RouterProcess],
) -> None:
    router = lone_router("--header-timeout", "1")
    silent = _connect(router.port)
    partial = _connect(router.port)
    partial.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never the blank line
    with silent, partial:
        assert _closed_by_server(silent) and _closed_by_server(partial)
    assert router_counter(router.url, "header_timeouts") >= 2


def test_idle_kept_alive_connection_is_closed_at_the_idle_timeout(
    lone_router: Callable[..., RouterProcess],
) -> None:
    router = lone_router("--idle-timeout", "1")
    with _connect(router.port) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        assert _closed_by_server(sock)


def test_connection_past_the_bound_gets_a_503(lone_router: Callable[..., RouterProcess]) -> None:
    router = lone_router("--max-connections", "4", "--header-timeout", "60")
    held = [_connect(router.port) for _ in range(4)]
    try:
        wait_for(lambda: _refused(router.url), timeout=15, what="a 503 past the bound")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(router.url + "/metrics", timeout=10)
        assert err.value.code == 503
        body = json.loads(err.value.read())
        assert "--max-connections" in body["error"]["message"]
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: not _refused(router.url), timeout=15, what="served again")
    assert router_counter(router.url, "connections_refused") >= 1


def _refused(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/metrics", timeout=10).read()
    except urllib.error.HTTPError as exc:
        return exc.code == 503
    return False


@pytest.fixture
def starved_router(run_dir: Path) -> Iterator[tuple[int, ManagedProcess]]:
    """A router limited to 64 descriptors, with no connection bound below that."""
    port = free_port()
    argv = [
        "prlimit",
        "--nofile=64",
        sys.executable,
        "-m",
        "bidir_kv",
        "proxy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefiller-hosts",
        "127.0.0.1",
        "--prefiller-ports",
        "9",
        "--decoder-hosts",
        "127.0.0.1",
        "--decoder-ports",
        "9",
        "--health-interval",
        "30",
        "--max-connections",
        "1000",
        "--header-timeout",
        "60",
    ]
    proc = ManagedProcess("starved-router", argv, run_dir / f"starved-{port}.log").start()
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/metrics", 30, alive=proc)
        yield port, proc
    finally:
        proc.stop()


def test_out_of_descriptors_is_one_log_line_and_accepting_resumes(
    starved_router: tuple[int, ManagedProcess],
) -> None:
    port, proc = starved_router
    flood = [_connect(port) for _ in range(100)]  # the kernel queues what the router cannot take
    try:
        line = "cannot accept client connections"
        wait_for(lambda: line in proc.log_path.read_text(), timeout=15, what="the EMFILE line")
    finally:
        for sock in flood:
            sock.close()
    wait_http_ok(f"http://127.0.0.1:{port}/metrics", 30, alive=proc)  # still accepting
    log = proc.log_path.read_text()
    assert log.count(line) == 1, log[-2000:]  # rate-limited: one line per 10 s
    assert router_counter(f"http://127.0.0.1:{port}", "accept_failures", errno="EMFILE") >= 1
