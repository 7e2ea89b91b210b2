"""Slow and abusive clients at ``bidir-kv proxy``: a connection that sends nothing or a
partial request is closed at --header-timeout, an idle kept-alive one at
--idle-timeout, one past the connection bound is answered 503 naming the bound, a
bound the descriptor limit cannot hold is lowered and said, and under descriptor
exhaustion (ulimit -n 128, a flood of partial request heads) every turn gets a 200 or
a 503 naming the limit, never a reset (router/listener.py, docs/router.md "Slow
clients and running out of descriptors").

Most routers here need no engine (their /metrics answers without one): the P and D
addresses point at a port nothing listens on.
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bidir_kv.client import fetch
from bidir_kv.launch.process import ManagedProcess, free_port, wait_http_ok
from bidir_kv.testing.engines import EnginePair
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
        reply = fetch(router.url + "/metrics", timeout=10)
        assert reply.status == 503
        assert "--max-connections" in reply.json()["error"]["message"]
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: not _refused(router.url), timeout=15, what="served again")
    assert router_counter(router.url, "connections_refused") >= 1


def _refused(url: str) -> bool:
    return fetch(url + "/metrics", timeout=10).status == 503


@pytest.fixture
def starved_router(run_dir: Path) -> Iterator[tuple[int, ManagedProcess]]:
    """A router limited to 64 descriptors that is asked for 1000 connections."""
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


def test_a_bound_the_descriptor_limit_cannot_hold_is_lowered_and_said(
    starved_router: tuple[int, ManagedProcess],
) -> None:
    """``--max-connections 1000`` under ``ulimit -n 64``: the router warns once at start,
    naming both, and serves at the lowered bound; a flood past it is answered 503 naming
    the limit, never left without descriptors (no accept fails), and it serves again
    once the flood is gone."""
    port, proc = starved_router
    log = proc.log_path.read_text()
    assert "--max-connections 1000 is more than the descriptor limit can hold" in log, log
    flood = [_connect(port) for _ in range(100)]  # the kernel queues what waits
    try:
        reply = fetch(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert reply.status == 503
        message = reply.json()["error"]["message"]
        assert "--max-connections 1000 lowered to" in message and "ulimit -n 64" in message
    finally:
        for sock in flood:
            sock.close()
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: not _refused(url), timeout=30, what="served again")
    assert router_counter(url, "connections_refused") >= 1
    assert router_counter(url, "accept_failures", errno="EMFILE") == 0


# ---- descriptor exhaustion: an answer for every client, never a reset ---------------

NOFILE = 128  # the router's descriptor limit (ulimit -n) in the exhaustion test
FLOOD = 160  # connections that send a partial request head and then nothing
TURNS = 10  # legitimate turns sent while the flood holds its connections


def _partial_head(port: int) -> socket.socket | None:
    """A connection that sends the start of a request head and never the blank line."""
    try:
        sock = _connect(port)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
    except OSError:  # refused already: it holds nothing
        return None
    return sock


def _turn_outcome(port: int, i: int) -> str:
    """One chat turn sent as a client streams a long request (a chunked body, its parts
    a few tens of milliseconds apart, as it builds them): ``200``, ``503: <message>``,
    or what went wrong (a reset, no answer). A router that closes while the client
    still writes resets the connection: the client never reads an answer."""
    history = " ".join(["kalo mine tesu"] * 800)
    body = json.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"turn {i}: {history}"}],
            "max_tokens": 4,
            "temperature": 0,
        }
    ).encode()
    parts = [body[j : j + len(body) // 4 + 1] for j in range(0, len(body), len(body) // 4 + 1)]

    def paced() -> Iterator[bytes]:
        for n, part in enumerate(parts):
            if n:
                time.sleep(0.05)  # the client's pace, not a wait for the router
            yield part

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=paced(),
            headers={"Content-Type": "application/json"},
            encode_chunked=True,
        )
        resp = conn.getresponse()
        status, raw = resp.status, resp.read()
    except (OSError, http.client.HTTPException) as exc:
        return f"no answer: {exc!r}"
    finally:
        conn.close()
    if status == 200:
        return "200" if json.loads(raw)["choices"][0]["message"]["content"] else f"200: {raw!r}"
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = repr(raw[:300])
    return f"{status}: {message}"


def test_descriptor_exhaustion_answers_every_turn_200_or_a_503_naming_the_limit(
    engine_pair: Callable[..., EnginePair], run_dir: Path
) -> None:
    """A router started under ``ulimit -n 128`` (default connection bound), flooded with
    160 connections that send a partial request head and hold it: each of ten turns
    sent meanwhile gets a 200 or a 503 whose message names the limit, never a reset
    or no answer (the router keeps a reserve of descriptors: router/listener.py)."""
    pair = engine_pair()
    p, d = pair.p.node, pair.d.node
    port = free_port()
    argv = [
        "prlimit",
        f"--nofile={NOFILE}",
        sys.executable,
        "-m",
        "bidir_kv",
        "proxy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefiller-hosts",
        p.host,
        "--prefiller-ports",
        str(p.port),
        "--decoder-hosts",
        d.host,
        "--decoder-ports",
        str(d.port),
        "--header-timeout",
        "120",
    ]
    proc = ManagedProcess("nofile-router", argv, run_dir / f"nofile-{port}.log").start()
    url = f"http://127.0.0.1:{port}"
    flood: list[socket.socket] = []
    try:
        wait_http_ok(url + "/health", 60, alive=proc)
        assert _turn_outcome(port, -1) == "200", "the router serves before the flood"
        flood = [s for s in (_partial_head(port) for _ in range(FLOOD)) if s is not None]
        with ThreadPoolExecutor(TURNS) as pool:
            outcomes = list(pool.map(lambda i: _turn_outcome(port, i), range(TURNS)))
        assert proc.returncode is None, proc.log_tail()
    finally:
        for sock in flood:
            sock.close()
        proc.stop()
    bad = [
        o
        for o in outcomes
        if o != "200" and not (o.startswith("503: ") and f"ulimit -n {NOFILE}" in o)
    ]
    assert not bad, f"turns without a 200 or a 503 naming the limit: {bad} (all: {outcomes})"
