"""The one way tests wait: poll an observable effect until it holds, or fail naming it.

Tests never sleep to synchronise; they poll what they are waiting for (an engine's
state, a metric, a log line, a process exit) against a deadline. On timeout the
error names the awaited condition (``what``, or the condition's own source line)
and the last value it returned, so a failure says what never happened.

A leaf module (standard library only): suites, fixtures and scenarios import it freely.
"""

from __future__ import annotations

import asyncio
import linecache
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from bidir_kv.errors import CheckFailure

__all__ = [
    "DEFAULT_INTERVAL",
    "DEFAULT_TIMEOUT",
    "WaitTimeout",
    "settled",
    "wait_for",
    "wait_for_async",
]

T = TypeVar("T")

DEFAULT_TIMEOUT = 10.0  # seconds; an emulated engine's effects land in milliseconds
DEFAULT_INTERVAL = 0.02  # seconds between two evaluations of the condition


class WaitTimeout(CheckFailure):
    """A polled condition did not hold in time (an assertion failure of the test)."""


def wait_for(
    condition: Callable[[], T | None],
    timeout: float = DEFAULT_TIMEOUT,
    what: str | None = None,
    *,
    interval: float = DEFAULT_INTERVAL,
) -> T:
    """Evaluate ``condition`` until it returns a truthy value, and return that value.

    Raises :class:`WaitTimeout` once ``timeout`` seconds passed without one; ``what``
    says what was awaited (default: the condition's name or source line).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(_timeout_message(condition, timeout, what, value))
        time.sleep(interval)


async def wait_for_async(
    condition: Callable[[], T | None],
    timeout: float = DEFAULT_TIMEOUT,
    what: str | None = None,
    *,
    interval: float = DEFAULT_INTERVAL,
) -> T:
    """:func:`wait_for` inside an event loop: the loop keeps running between evaluations."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(_timeout_message(condition, timeout, what, value))
        await asyncio.sleep(interval)


def settled(
    read: Callable[[], T],
    timeout: float = 5.0,
    *,
    interval: float = 0.05,
    same: Callable[[T, T], bool] = lambda a, b: a == b,
) -> T:
    """Read until two consecutive reads are the ``same`` and return the later one.

    For counters that land a step after the event that moved them (an engine's
    ``/metrics`` after a response). It never fails: after ``timeout`` seconds it returns
    the latest read, and the caller's assertion on that value says what was wrong.
    """
    deadline = time.monotonic() + timeout
    prev = read()
    while time.monotonic() < deadline:
        time.sleep(interval)
        cur = read()
        if same(prev, cur):
            return cur
        prev = cur
    return prev


def _timeout_message(
    condition: Callable[[], object], timeout: float, what: str | None, last: object
) -> str:
    awaited = what if what is not None else _describe(condition)
    return f"timed out after {timeout:g} s waiting for {awaited} (last value: {last!r})"


def _describe(condition: Callable[[], object]) -> str:
    """Where a condition is written: ``name() at file:line``, or a lambda's source line."""
    name = getattr(condition, "__qualname__", None) or repr(condition)
    code = getattr(condition, "__code__", None)
    if code is None:
        return name
    where = f"{Path(code.co_filename).name}:{code.co_firstlineno}"
    if name.endswith("<lambda>"):
        line = linecache.getline(code.co_filename, code.co_firstlineno).strip()
        return f"the condition at {where} ({line})" if line else f"the condition at {where}"
    return f"{name}() at {where}"
