"""The renewable decode-side lease: when a router frees a conversation's blocks on D.

A fixed ``decoder_kv_blocks_ttl`` holds every finished turn's KV for the whole TTL,
whether the conversation goes on or was abandoned. With a lease the router holds a
turn's entry for ``idle`` seconds after the conversation's last activity (the turn
itself, or a keep-alive) and frees D's blocks when that passes or when the
conversation is closed; the router's ``cache_ttl`` (below D's TTL) stays the hard
cap. Pure: time comes in as arguments.
"""

from __future__ import annotations

import math

__all__ = ["lease_deadline", "lease_expired", "valid_conversation_lease"]


def valid_conversation_lease(idle: object) -> bool:
    """A lease is a finite positive number of seconds (``bool`` is not one)."""
    return (
        isinstance(idle, int | float)
        and not isinstance(idle, bool)
        and math.isfinite(idle)
        and idle > 0
    )


def lease_deadline(last_activity: float, idle: float) -> float:
    """When an entry last renewed at ``last_activity`` expires: ``idle`` seconds later."""
    return last_activity + idle


def lease_expired(deadline: float, now: float) -> bool:
    """True once ``now`` reaches the deadline (an entry renewed exactly ``idle`` ago is gone)."""
    return now >= deadline
