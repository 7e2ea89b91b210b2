"""The ``--workers`` supervisor's rules (bidir_kv/router/workers.py) on a scripted OS: a
dead worker is replaced after a backoff that doubles per recent death (capped), deaths
older than the window are forgotten, more than ``max_deaths`` within it stop the others
and exit 1, a stop signal is passed to every worker and deaths after it are not replaced.

The supervisor forks nothing here: its OS calls (fork, wait, kill, signal handlers, the
clock and its sleep) are a script (the real processes are in
suites/integration/test_router_workers.py and test_router_supervisor.py).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest

from bidir_kv.router.workers import (
    RESPAWN_DELAY_MAX_S,
    RESPAWN_DELAY_S,
    _Supervisor,
    _System,
)

Event = tuple[float, int, int] | Callable[["_Script"], None]  # (at, pid, status) or an action


class _Script:
    """The OS as the supervisor sees it: forked pids count up from 100; ``wait`` returns
    the scripted deaths in order (the clock jumps to each one's time)."""

    def __init__(self, events: list[Event]) -> None:
        self.events = list(events)
        self.now = 1000.0
        self.forked: list[int] = []
        self.killed: list[tuple[int, int]] = []
        self.slept: list[float] = []
        self.handlers: dict[int, Any] = {}
        self.sup: _Supervisor | None = None

    def fork(self) -> int:
        self.forked.append(100 + len(self.forked))
        return self.forked[-1]

    def wait(self) -> tuple[int, int]:
        while True:
            event = self.events.pop(0)
            if callable(event):
                event(self)
                continue
            at, pid, status = event
            self.now = max(self.now, at)
            return pid, status

    def waitpid(self, pid: int, options: int) -> tuple[int, int]:
        return pid, 0

    def kill(self, pid: int, sig: int) -> None:
        self.killed.append((pid, sig))

    def handle(self, sig: int, handler: Any) -> None:
        self.handlers[sig] = handler

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def system(self) -> _System:
        return _System(
            fork=self.fork,
            wait=self.wait,
            waitpid=self.waitpid,
            kill=self.kill,
            handle=self.handle,
            clock=self.clock,
            sleep=self.sleep,
        )


def _supervise(
    events: list[Event], *, count: int = 1, max_deaths: int = 5, window: float = 60.0
) -> tuple[int, _Script, _Supervisor]:
    script = _Script(events)
    sup = _Supervisor(count, lambda i, r: 0, max_deaths, window, system=script.system())
    script.sup = sup
    return sup.run(), script, sup


def _term(script: _Script) -> None:
    """SIGTERM reaches the supervisor (its handler runs)."""
    script.handlers[signal.SIGTERM](signal.SIGTERM, None)


def _waited(script: _Script) -> float:
    """Seconds the supervisor waited in its backoff since the last call."""
    total, script.slept[:] = sum(script.slept), []
    return total


def test_deaths_older_than_the_window_are_forgotten() -> None:
    # one worker dying every 100 s, window 60 s, at most 1 death in it: never gives up,
    # and each replacement waits the first backoff only
    events: list[Event] = [(1000.0 + 100 * i, 100 + i, 256) for i in range(5)]
    code, script, sup = _supervise([*events, _term, (2000.0, 105, 0)], max_deaths=1)
    assert code == 0
    assert script.forked == [100, 101, 102, 103, 104, 105]
    assert sup.restarts.value == 5
    assert len(sup.deaths) == 1  # only the last death is recent
    # each replacement waited the first backoff (in 50 ms steps), never a doubled one
    assert sum(script.slept) == pytest.approx(5 * RESPAWN_DELAY_S, abs=5 * 0.051)
    assert sum(script.slept) < 5 * 2 * RESPAWN_DELAY_S


def test_more_deaths_than_allowed_within_the_window_stop_every_worker_and_exit_1(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # two workers; deaths at +0, +10, +20 s, at most 2 within 60 s: the third stops it
    code, script, sup = _supervise(
        [(1000.0, 100, 256), (1010.0, 102, 256), (1020.0, 103, 9), (1021.0, 101, 0)],
        count=2,
        max_deaths=2,
    )
    assert code == 1
    assert script.forked == [100, 101, 102, 103]
    assert sup.restarts.value == 2
    assert (101, signal.SIGTERM) in script.killed  # the worker still up is stopped
    assert "3 router workers died within 60 s: stopping all of them" in caplog.text
    assert "router worker 0 (pid 100) exited with status 1" in caplog.text
    assert "router worker 0 (pid 103) exited with status -9" in caplog.text  # killed


def test_the_backoff_doubles_per_recent_death_up_to_its_cap() -> None:
    deaths = [(1000.0 + i, 100 + i, 256) for i in range(9)]
    script = _Script([*deaths, _term, (1100.0, 109, 0)])
    sup = _Supervisor(1, lambda i, r: 0, 50, 3600.0, system=script.system())
    waits: list[float] = []
    respawn = sup.spawn

    def spawn(index: int) -> None:
        waits.append(_waited(script))
        respawn(index)

    sup.spawn = spawn  # type: ignore[method-assign]
    assert sup.run() == 0
    expected = [min(RESPAWN_DELAY_MAX_S, RESPAWN_DELAY_S * 2**i) for i in range(9)]
    assert waits[1:] == pytest.approx(expected, abs=0.051)
    assert sup.restarts.value == 9


def test_a_stop_is_passed_to_every_worker_and_deaths_after_it_are_not_replaced() -> None:
    code, script, sup = _supervise(
        [_term, (1001.0, 100, 0), (1001.5, 102, 256), (1002.0, 101, 0)], count=3
    )
    assert code == 0
    assert script.forked == [100, 101, 102]  # nothing replaced
    assert sorted(script.killed) == [(100, 15), (101, 15), (102, 15)]
    assert sup.restarts.value == 0 and not sup.deaths
    assert set(script.handlers) == {signal.SIGINT, signal.SIGTERM}


def test_a_stop_during_the_backoff_ends_it_without_a_replacement() -> None:
    stop_at_first_sleep = _Script([(1000.0, 100, 256), (1001.0, 100, 0)])
    sup = _Supervisor(1, lambda i, r: 0, 5, 60.0, system=stop_at_first_sleep.system())
    stop_at_first_sleep.sleep = lambda s: sup.forward(signal.SIGTERM)  # type: ignore[method-assign]
    sup.os = stop_at_first_sleep.system()
    assert sup.run() == 0
    assert stop_at_first_sleep.forked == [100] and sup.restarts.value == 0


def test_a_child_that_is_not_a_worker_is_ignored() -> None:
    code, script, sup = _supervise([(1000.0, 4242, 0), _term, (1001.0, 100, 0)])
    assert code == 0 and script.forked == [100] and not sup.deaths


def test_a_worker_gone_before_the_stop_reaches_it_is_not_an_error() -> None:
    script = _Script([_term, (1001.0, 100, 0)])

    def gone(pid: int, sig: int) -> None:
        raise ProcessLookupError

    sup = _Supervisor(1, lambda i, r: 0, 5, 60.0, system=script.system())
    sup.os = _System(**{**vars(script.system()), "kill": gone})
    assert sup.run() == 0
