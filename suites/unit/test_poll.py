"""The tests' one way to wait (bidir_kv.testing.poll)."""

from __future__ import annotations

import pytest

from bidir_kv.testing.poll import WaitTimeout, settled, wait_for, wait_for_async


def test_wait_for_returns_the_first_truthy_value_and_names_what_never_happened() -> None:
    values = iter([0, [], "ready"])
    assert wait_for(lambda: next(values), 5, interval=0) == "ready"
    with pytest.raises(WaitTimeout, match=r"waiting for the pair to start \(last value: 0\)"):
        wait_for(lambda: 0, 0.01, "the pair to start", interval=0)


async def test_wait_for_async_keeps_the_loop_running() -> None:
    values = iter([None, None, 3])
    assert await wait_for_async(lambda: next(values), 5, interval=0) == 3


def test_settled_returns_once_two_reads_agree_and_the_latest_at_its_timeout() -> None:
    reads = iter([1, 2, 2, 3])
    assert settled(lambda: next(reads), 5, interval=0) == 2
    moving = iter(range(10**9))
    assert settled(lambda: next(moving), 0.01, interval=0.001) > 0
    pairs = iter([(1, "a"), (1, "b")])
    assert settled(lambda: next(pairs), 5, interval=0, same=lambda a, b: a[0] == b[0]) == (1, "b")
