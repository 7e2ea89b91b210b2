"""Injected clocks: the real monotonic one, a manual one and an offset one."""

from __future__ import annotations

import time

import pytest

from bidir_kv.testing.clock import Clock, ManualClock, MonotonicClock, OffsetClock


def test_monotonic_clock_is_perf_counter_and_never_goes_back() -> None:
    clock = MonotonicClock()
    before = time.perf_counter()
    readings = [clock.now() for _ in range(1000)]
    after = time.perf_counter()
    assert readings == sorted(readings)
    assert before <= readings[0] and readings[-1] <= after


def test_all_clocks_satisfy_the_protocol() -> None:
    base = ManualClock()
    for clock in (MonotonicClock(), base, OffsetClock(base, 1.0)):
        assert isinstance(clock, Clock)
    assert not isinstance(object(), Clock)


def test_manual_clock_moves_only_when_told() -> None:
    clock = ManualClock(10)
    assert clock.now() == 10.0 and isinstance(clock.now(), float)
    assert clock.now() == 10.0
    assert clock.advance(2.5) == 12.5
    assert clock.advance(0) == 12.5
    clock.set(20)
    assert clock.now() == 20.0
    clock.set(20)
    assert clock.now() == 20.0


def test_manual_clock_refuses_to_go_back() -> None:
    clock = ManualClock(5)
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-0.1)
    with pytest.raises(ValueError, match="backwards"):
        clock.set(4.9)
    assert clock.now() == 5.0


@pytest.mark.parametrize("offset", [-1000.5, 0.0, 3600.0])
def test_offset_clock_follows_its_base(offset: float) -> None:
    base = ManualClock(100)
    peer = OffsetClock(base, offset)
    assert peer.now() == 100 + offset
    base.advance(7)
    assert peer.now() == 107 + offset
    assert peer.now() - base.now() == pytest.approx(offset)


def test_offset_clock_over_a_real_clock() -> None:
    peer = OffsetClock(MonotonicClock(), 50.0)
    a = time.perf_counter()
    b = peer.now()
    c = time.perf_counter()
    assert a + 50 <= b <= c + 50
