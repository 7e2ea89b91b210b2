"""Clocks for tests that drive time-dependent rules without sleeping.

The rules take time as an argument (``now``), and the runtimes pass
``time.perf_counter()`` itself, the clock vLLM stamps ``remote_blocks_expiry_time``
with (docs/protocol.md §3.6, §5.3); tests drive the rules with :class:`ManualClock`
(and :class:`OffsetClock` for a peer whose clock differs) instead.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "ManualClock", "MonotonicClock", "OffsetClock"]


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale whose origin is private to the clock."""
        ...


class MonotonicClock:
    """``time.perf_counter()``, the clock vLLM's scheduler uses for expiry."""

    def now(self) -> float:
        return time.perf_counter()


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"cannot move a monotonic clock backwards ({seconds} s)")
        self._t += seconds
        return self._t

    def set(self, t: float) -> None:
        if t < self._t:
            raise ValueError(f"cannot move a monotonic clock backwards ({self._t} -> {t})")
        self._t = float(t)


class OffsetClock:
    """Another clock shifted by a fixed offset (emulates a peer's unrelated origin or skew)."""

    def __init__(self, base: Clock, offset: float) -> None:
        self.base = base
        self.offset = float(offset)

    def now(self) -> float:
        return self.base.now() + self.offset
