"""Ports for test processes: two picks never collide, and outgoing connections cannot take one."""

from __future__ import annotations

from bidir_kv.launch.process import _ephemeral_range, free_port


def test_picks_never_repeat_and_lie_apart() -> None:
    ports = [free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
    assert all(abs(a - b) >= 16 for i, a in enumerate(ports) for b in ports[i + 1 :])


def test_picks_lie_below_the_ephemeral_range() -> None:
    # bind(0) hands out ephemeral ports, which any client socket may take before the
    # child binds (an engine once failed with "address already in use" that way)
    low, _ = _ephemeral_range()
    assert all(free_port() < low for _ in range(16))
