"""``bidir-kv proxy --workers 2`` on Redis when a worker dies: the supervisor replaces
it, the other worker's turns complete, every conversation's next turn still hits (the
store is shared), SIGTERM drains and exits 0, and too many deaths exit 1.

Stub engines run in this process on a thread of their own, so the test reads every
request P got (a hit is a P request that carries D's blocks).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from aiohttp import web

from bidir_kv.client import CHAT_PATH, TransportError, fetch, scrape
from bidir_kv.launch.process import free_port
from bidir_kv.protocol import params_from_request
from bidir_kv.testing.doubles.stub_engine import StubEngine
from bidir_kv.testing.faults import kill_pid
from bidir_kv.testing.poll import wait_for
from bidir_kv.testing.router import RouterProcess
from bidir_kv.topology.redis_server import RedisServer


class Engines:
    """A stub P and D served on a background event loop."""

    def __init__(self) -> None:
        self.p, self.d = StubEngine(name="p", side_port=5600), StubEngine(name="d", side_port=5700)
        self.ports = (free_port(), free_port())
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._runners: list[web.AppRunner] = []

    async def _start(self) -> None:
        for eng, port in zip((self.p, self.d), self.ports, strict=True):
            runner = web.AppRunner(eng.app(), access_log=None, shutdown_timeout=0.5)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self._runners.append(runner)

    async def _stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()

    def __enter__(self) -> Engines:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    def hits(self) -> int:
        """P requests that carried D's blocks (the router offered a hit)."""
        return sum(
            1
            for r in list(self.p.received)
            if (p := params_from_request(r["body"])) is not None and p.has_remote_blocks
        )


@pytest.fixture
def engines() -> Iterator[Engines]:
    with Engines() as e:
        yield e


def _workers(router: RouterProcess) -> set[int]:
    pid = router.proc.pid
    assert pid is not None
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return set()
    return {int(x) for x in text.split()}


def _turn(url: str, conv: str, messages: list[dict[str, str]]) -> tuple[int | None, str]:
    """(status, text); status ``None``: no HTTP answer (the worker holding the
    connection was killed)."""
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "conversation_id": conv}
    try:
        reply = fetch(
            url + CHAT_PATH, method="POST", json=body, headers={"Connection": "close"}, timeout=30
        )
    except TransportError as exc:
        return None, type(exc).__name__
    if not reply.ok:
        return reply.status, ""
    return reply.status, reply.json()["choices"][0]["message"]["content"]


def _router(
    router_process: Callable[..., RouterProcess], engines: Engines, redis: RedisServer, *flags: str
) -> RouterProcess:
    router = router_process(
        [("127.0.0.1", engines.ports[0])],
        [("127.0.0.1", engines.ports[1])],
        extra=("--workers", "2", "--store", redis.url, "--health-interval", "0.5", *flags),
    )
    wait_for(lambda: len(_workers(router)) == 2, timeout=20, what="two workers")
    return router


def test_killed_worker_is_replaced_and_conversations_keep_hitting(
    router_process: Callable[..., RouterProcess], engines: Engines, redis_server: RedisServer
) -> None:
    router = _router(router_process, engines, redis_server)
    convs = {f"conv-{i}": [{"role": "user", "content": f"hello number {i} " * 8}] for i in range(8)}
    for conv, msgs in convs.items():  # turn 1 of each, stored in Redis
        status, text = _turn(router.url, conv, msgs)
        assert status == 200
        msgs.append({"role": "assistant", "content": text})
    first = _workers(router)
    victim = min(first)
    engines.p.prefill_delay = 1.5  # the next turns are in flight when the victim dies
    asked = len(engines.p.received)
    with ThreadPoolExecutor(16) as pool:
        flight = [
            pool.submit(
                _turn, router.url, f"flight-{i}", [{"role": "user", "content": f"in flight {i}"}]
            )
            for i in range(16)
        ]
        wait_for(lambda: len(engines.p.received) - asked >= 16, timeout=20, what="16 turns at P")
        kill_pid(victim, "router worker")  # SIGKILL, checked gone
        results = [f.result() for f in flight]
    engines.p.prefill_delay = 0.0
    done = [s for s, _ in results if s == 200]
    assert done, results  # the other worker's turns completed
    assert all(s in (None, 200) for s, _ in results), results  # cut ones: no answer, no 5xx
    wait_for(
        lambda: len(_workers(router)) == 2 and victim not in _workers(router),
        timeout=20,
        what="the dead worker replaced",
    )
    assert router.proc.returncode is None
    hits_before = engines.hits()
    for conv, msgs in convs.items():  # turn 2: any worker, each on a new connection
        msgs.append({"role": "user", "content": "and then?"})
        status, _ = _turn(router.url, conv, msgs)
        assert status == 200
    assert engines.hits() - hits_before == len(convs)
    assert _restarts(router.url) == 1.0  # either worker reads the supervisor's count


def _restarts(url: str) -> float:
    return scrape(url).value("bidir_kv_router_worker_restarts")


def test_worker_exiting_on_its_own_is_replaced_and_counted(
    router_process: Callable[..., RouterProcess], engines: Engines, redis_server: RedisServer
) -> None:
    router = _router(router_process, engines, redis_server)
    victim = min(_workers(router))
    kill_pid(victim, "router worker", signal.SIGTERM, timeout=20)  # drains, exits 0 itself
    wait_for(
        lambda: len(_workers(router)) == 2 and victim not in _workers(router),
        timeout=20,
        what="the worker replaced",
    )
    wait_for(lambda: _restarts(router.url) == 1.0, timeout=10, what="restarts == 1")
    assert router.proc.returncode is None


def test_sigterm_drains_in_flight_turns_and_exits_zero(
    router_process: Callable[..., RouterProcess], engines: Engines, redis_server: RedisServer
) -> None:
    router = _router(router_process, engines, redis_server)
    engines.p.prefill_delay = 1.5
    with ThreadPoolExecutor(4) as pool:
        flight = [
            pool.submit(
                _turn, router.url, f"drain-{i}", [{"role": "user", "content": f"drain {i}"}]
            )
            for i in range(4)
        ]
        wait_for(lambda: len(engines.p.received) >= 4, timeout=20, what="4 turns at P")
        router.proc.send_signal(signal.SIGTERM)
        results = [f.result() for f in flight]
    assert [s for s, _ in results] == [200] * 4, results
    wait_for(lambda: router.proc.returncode is not None, timeout=30, what="the router exits")
    assert router.proc.returncode == 0


def test_too_many_deaths_stop_the_router_with_exit_1(
    router_process: Callable[..., RouterProcess], engines: Engines, redis_server: RedisServer
) -> None:
    router = _router(router_process, engines, redis_server, "--worker-max-deaths", "1")
    first = min(_workers(router))
    kill_pid(first, "router worker")
    wait_for(
        lambda: len(_workers(router)) == 2 and first not in _workers(router),
        timeout=20,
        what="the first death replaced",
    )
    kill_pid(min(_workers(router)), "router worker")
    wait_for(lambda: router.proc.returncode is not None, timeout=30, what="the router exits")
    assert router.proc.returncode == 1
    assert "router workers died within" in router.log()
