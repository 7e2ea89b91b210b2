"""When a router's cached conversation entry may still be reused.

An entry names blocks D holds for at most ``decoder_kv_blocks_ttl`` after the
turn finished; the router trusts it for ``cache_ttl`` seconds, which must stay
below D's retention so an entry never points at blocks D may have reused.
Every store (memory, Redis) and the CLI ask these functions.
"""

from __future__ import annotations

__all__ = ["cache_ttl_within_retention", "entry_age", "entry_is_stale", "stale_cutoff"]


def entry_age(created: float, now: float) -> float:
    """Seconds since the entry was stored (never negative across clock steps)."""
    return max(0.0, now - created)


def stale_cutoff(now: float, ttl: float) -> float:
    """Creation time before which an entry is stale; one created at the cutoff is fresh."""
    return now - ttl


def entry_is_stale(created: float, now: float, ttl: float) -> bool:
    """True when an entry created at ``created`` is older than ``ttl`` at ``now``."""
    return created < stale_cutoff(now, ttl)


def cache_ttl_within_retention(cache_ttl: float, decoder_kv_blocks_ttl: float) -> bool:
    """True when the router's TTL ends before D may release (and reuse) the blocks."""
    return cache_ttl < decoder_kv_blocks_ttl
