"""When a router's cached conversation entry may still be reused.

An entry names blocks D holds for at most ``decoder_kv_blocks_ttl`` after the
turn finished; the router trusts it for ``cache_ttl`` seconds, which must stay
below D's retention so an entry never points at blocks D may have reused.
Every store (memory, Redis) and the CLI ask these functions.
"""

from __future__ import annotations

from bidir_kv.policy.retention import DEFAULT_DECODER_KV_BLOCKS_TTL

__all__ = [
    "cache_ttl_below_retention",
    "cache_ttl_within_retention",
    "entry_age",
    "entry_is_stale",
    "scaled_cache_ttl",
    "stale_cutoff",
]


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


def scaled_cache_ttl(decoder_kv_blocks_ttl: float, cache_ttl: float) -> float:
    """A router TTL for D's TTL, in the upstream ratio (``cache_ttl`` under vLLM's 480 s).

    Benchmarks that shorten D's TTL keep the router's TTL below it by the same ratio
    as the upstream proxy's defaults, and never above ``cache_ttl``.
    """
    return min(cache_ttl, decoder_kv_blocks_ttl * cache_ttl / DEFAULT_DECODER_KV_BLOCKS_TTL)


def cache_ttl_below_retention(decoder_kv_blocks_ttl: float, margin: float) -> float:
    """A router TTL ``margin`` seconds under D's TTL (at least 1 s), for short test TTLs."""
    return max(1.0, decoder_kv_blocks_ttl - margin)
