"""Where a new turn goes: the engine with the least work, counting what is coming.

A node's load is its *active* requests (every request routed to it from the moment
it was picked, not only once its leg started: requests picked during the same P
leg would otherwise all see the same counts and pile onto one node) plus its
*held* work (finished turns whose KV it keeps pinned for a next turn), weighted
by ``held_weight`` (a pinned turn costs memory, not compute).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["least_loaded", "node_load"]


def node_load(active: int, held: int, held_weight: float) -> float:
    """The load a placement compares: active requests plus weighted held turns."""
    return active + held_weight * held


def least_loaded(loads: Sequence[float]) -> list[int]:
    """Indices of the nodes tied at the lowest load (the caller rotates among them)."""
    if not loads:
        return []
    low = min(loads)
    return [i for i, load in enumerate(loads) if load == low]
