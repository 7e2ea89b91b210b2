"""In-process conversation store (one router replica, lost on restart)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from bidir_kv.policy import entry_is_stale
from bidir_kv.router.store.base import ConversationStore, Entry

__all__ = ["MemoryStore"]


class MemoryStore(ConversationStore):
    """A dict in creation order (entries are single use, so that is LRU order)."""

    kind = "memory"

    def __init__(self, ttl: float, max_entries: int, now: Callable[[], float] = time.time):
        super().__init__(ttl, max_entries, now)
        self._entries: OrderedDict[str, Entry] = OrderedDict()

    async def _pop(self, key: str) -> Entry | None:
        return self._entries.pop(key, None)

    async def put(self, key: str, entry: Entry) -> None:
        self._evicted([self._entries.pop(key, None)], "replaced")
        self._entries[key] = entry
        while len(self._entries) > self.max_entries:
            _, old = self._entries.popitem(last=False)
            self.evicted_lru += 1
            self._evicted([old], "evicted")

    async def size(self) -> int:
        now = self.now()
        return sum(
            1
            for entry in self._entries.values()
            if not entry_is_stale(entry.created, now, self.ttl)
        )

    async def sweep(self) -> int:
        now = self.now()
        stale = [
            key
            for key, entry in self._entries.items()
            if entry_is_stale(entry.created, now, self.ttl)
        ]
        self._evicted([self._entries.pop(key) for key in stale], "stale")
        self.evicted_stale += len(stale)
        return len(stale)
