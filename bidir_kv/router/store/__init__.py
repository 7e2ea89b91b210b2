"""Conversation stores behind one interface (:class:`ConversationStore`).

Reading path: ``base`` (the interface and its single-use ``take``), then ``memory``;
``redis`` is the shared one.

``memory`` keeps entries in the router process; ``redis`` shares them between
replicas and across restarts. A new store subclasses :class:`ConversationStore`
in a module here and gets a spec in :func:`open_store`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from bidir_kv.router.store.base import (
    ConversationStore,
    Entry,
    EvictionHook,
    Renewal,
    StoreError,
    Taken,
)
from bidir_kv.router.store.memory import MemoryStore
from bidir_kv.router.store.redis import RedisStore

__all__ = [
    "REDIS_SCHEMES",
    "ConversationStore",
    "Entry",
    "EvictionHook",
    "MemoryStore",
    "RedisStore",
    "Renewal",
    "StoreError",
    "Taken",
    "is_store_spec",
    "open_store",
]

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def is_store_spec(spec: str) -> bool:
    """``memory`` or a URL a Redis client opens."""
    return spec == "memory" or spec.startswith(REDIS_SCHEMES)


def open_store(
    spec: str,
    ttl: float,
    max_entries: int,
    now: Callable[[], float] = time.time,
    max_concurrency: int = 128,
) -> ConversationStore:
    """``memory`` or a ``redis://`` / ``rediss://`` / ``unix://`` URL; a Redis store's
    connection pool holds ``max_concurrency`` connections and blocks beyond them."""
    if spec == "memory":
        return MemoryStore(ttl, max_entries, now)
    if spec.startswith(REDIS_SCHEMES):
        return RedisStore(spec, ttl, max_entries, now, max_connections=max_concurrency)
    raise ValueError(f"--store must be 'memory' or a redis:// URL, got {spec!r}")
