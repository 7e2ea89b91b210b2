"""In-process conversation store (one router replica, lost on restart)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from bidir_kv.policy import entry_is_stale, lease_deadline, lease_expired
from bidir_kv.router.store.base import ConversationStore, Entry, Renewal

__all__ = ["MemoryStore"]


class MemoryStore(ConversationStore):
    """A dict in creation order (entries are single use, so that is LRU order), plus
    the lease deadlines of leased entries."""

    kind = "memory"

    def __init__(self, ttl: float, max_entries: int, now: Callable[[], float] = time.time):
        super().__init__(ttl, max_entries, now)
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._deadlines: dict[str, float] = {}
        self._in_flight: dict[str, float] = {}  # key -> when its last turn took (store clock)
        self._closed: dict[str, float] = {}  # key -> when it was closed (the tombstone)
        self._index: dict[str, str] = {}  # index key -> the entry's key (take_first)
        self._indexed: dict[str, tuple[str, ...]] = {}  # entry key -> its index keys

    def _remove(self, key: str) -> Entry | None:
        self._deadlines.pop(key, None)
        for ix in self._indexed.pop(key, ()):
            if self._index.get(ix) == key:  # not moved to a newer entry since
                del self._index[ix]
        return self._entries.pop(key, None)

    async def _pop_first(self, keys: Sequence[str]) -> tuple[int, Entry] | None:
        for i, ix in enumerate(keys):
            name = self._index.get(ix)
            entry = None if name is None else self._remove(name)
            if entry is not None:
                return i, entry
        return None

    async def _pop(self, key: str, turn: bool = False) -> Entry | None:
        if turn:
            self._in_flight[key] = self.now()
        return self._remove(key)

    async def _close(self, key: str) -> tuple[Entry | None, bool]:
        now = self.now()
        self._forget_marks(now)
        self._closed[key] = now
        return self._remove(key), key in self._in_flight

    def _forget_marks(self, now: float) -> None:
        """Marks older than the TTL mean nothing any more (a turn that never stored)."""
        for marks in (self._in_flight, self._closed):
            for key in [k for k, t in marks.items() if entry_is_stale(t, now, self.ttl)]:
                del marks[key]

    async def put(
        self, key: str, entry: Entry, since: float | None = None, index: Sequence[str] = ()
    ) -> bool:
        self._in_flight.pop(key, None)
        closed = self._closed.get(key)
        if since is not None and closed is not None and closed >= since:
            return False
        self._evicted([self._remove(key)], "replaced")
        self._entries[key] = entry
        if index:
            self._indexed[key] = tuple(index)
            for ix in index:
                self._index[ix] = key
        if entry.lease is not None:
            self._deadlines[key] = lease_deadline(entry.created, entry.lease)
        while len(self._entries) > self.max_entries:
            old_key = next(iter(self._entries))
            old = self._remove(old_key)
            self.evicted_lru += 1
            self._evicted([old], "evicted")
        return True

    async def renew(self, key: str) -> Renewal | None:
        entry = self._entries.get(key)
        now = self.now()
        if entry is None or entry_is_stale(entry.created, now, self.ttl):
            return None
        if entry.lease is None:
            return Renewal(None, None)
        deadline = self._deadlines[key] = lease_deadline(now, entry.lease)
        return Renewal(entry.lease, deadline)

    async def expire_leases(self) -> int:
        now = self.now()
        gone = [key for key, deadline in self._deadlines.items() if lease_expired(deadline, now)]
        self._evicted([self._remove(key) for key in gone], "lease_expired")
        return len(gone)

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
        self._evicted([self._remove(key) for key in stale], "stale")
        self.evicted_stale += len(stale)
        return len(stale)
