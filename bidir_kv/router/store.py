"""ConversationStore: (tenant, conversation) -> D's last ``kv_transfer_params``.

Entries are single use (a take removes them: two concurrent turns of one
conversation cannot both import the same blocks) and bounded by a TTL kept below
D's ``decoder_kv_blocks_ttl`` and by a maximum count (oldest evicted first).

Two backends: in-process memory, and Redis (redis-py asyncio) so that several
router replicas and restarts share the hits. Redis's ``GETDEL`` makes the take
atomic across replicas.
"""

from __future__ import annotations

import abc
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from bidir_kv.protocol import KVTransferParams

__all__ = [
    "ConversationStore",
    "Entry",
    "MemoryStore",
    "RedisStore",
    "StoreError",
    "Taken",
    "open_store",
]

_FORMAT: Final = 1


class StoreError(RuntimeError):
    """The store is unreachable or holds something we cannot read."""


@dataclass(frozen=True, slots=True)
class Entry:
    """What one finished turn leaves behind for the next one.

    ``tokens`` is D's token sequence (prompt + generated ids) when the D leg
    returned token ids; the continuation guard compares the next prompt with it.
    ``decode``/``prefill`` name the backends (``host:port``) for sticky routing.
    Token ids are kept as ``array('I')`` (4 bytes each, not a Python int object).
    """

    params: KVTransferParams
    decode: str
    prefill: str | None
    created: float
    tokens: Sequence[int] | None = None

    def to_bytes(self) -> bytes:
        toks = None
        if self.tokens is not None:
            arr = self.tokens if isinstance(self.tokens, array) else array("I", self.tokens)
            toks = arr.tobytes()
        packed: bytes = msgpack.packb(
            {
                "v": _FORMAT,
                "params": self.params.to_dict(),
                "d": self.decode,
                "p": self.prefill,
                "t": self.created,
                "tok": toks,
            },
            use_bin_type=True,
        )
        return packed

    @classmethod
    def from_bytes(cls, raw: bytes) -> Entry:
        try:
            obj = msgpack.unpackb(raw, raw=False)
            if not isinstance(obj, dict) or obj.get("v") != _FORMAT:
                raise ValueError("unknown entry format")
            toks = obj.get("tok")
            tokens = None
            if toks is not None:
                tokens = array("I")
                tokens.frombytes(toks)
            return cls(
                params=KVTransferParams.parse(obj["params"]),
                decode=str(obj["d"]),
                prefill=None if obj.get("p") is None else str(obj["p"]),
                created=float(obj["t"]),
                tokens=tokens,
            )
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
            raise StoreError(f"unreadable conversation entry: {exc}") from None


@dataclass(frozen=True, slots=True)
class Taken:
    """Result of a take: the entry if fresh; ``stale`` with its age if it had expired."""

    entry: Entry | None
    stale: bool = False
    age: float = 0.0


class ConversationStore(abc.ABC):
    """Async store interface; ``ttl`` in seconds, ``now`` is wall-clock seconds."""

    kind: str = "abstract"

    def __init__(self, ttl: float, max_entries: int, now: Callable[[], float] = time.time):
        if ttl <= 0:
            raise ValueError(f"cache TTL must be positive, got {ttl}")
        if max_entries <= 0:
            raise ValueError(f"max conversations must be positive, got {max_entries}")
        self.ttl = float(ttl)
        self.max_entries = int(max_entries)
        self.now = now
        self.evicted_stale = 0
        self.evicted_lru = 0

    def _judge(self, entry: Entry | None) -> Taken:
        if entry is None:
            return Taken(None)
        age = max(0.0, self.now() - entry.created)
        if age > self.ttl:
            self.evicted_stale += 1
            return Taken(None, stale=True, age=age)
        return Taken(entry, age=age)

    @abc.abstractmethod
    async def take(self, key: str) -> Taken:
        """Remove and return the entry (single use)."""

    @abc.abstractmethod
    async def put(self, key: str, entry: Entry) -> None:
        """Store (overwrite) the entry for ``key``."""

    @abc.abstractmethod
    async def size(self) -> int:
        """Number of live (non-stale) entries."""

    @abc.abstractmethod
    async def sweep(self) -> int:
        """Drop stale entries; return how many."""

    async def ping(self) -> None:  # noqa: B027 - optional hook, nothing to check in memory
        """Raise :class:`StoreError` when the store is unreachable."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class MemoryStore(ConversationStore):
    """In-process dict in creation order (entries are single use, so that is LRU order)."""

    kind = "memory"

    def __init__(self, ttl: float, max_entries: int, now: Callable[[], float] = time.time):
        super().__init__(ttl, max_entries, now)
        self._d: OrderedDict[str, Entry] = OrderedDict()

    async def take(self, key: str) -> Taken:
        return self._judge(self._d.pop(key, None))

    async def put(self, key: str, entry: Entry) -> None:
        self._d.pop(key, None)
        self._d[key] = entry
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)
            self.evicted_lru += 1

    async def size(self) -> int:
        cutoff = self.now() - self.ttl
        return sum(1 for e in self._d.values() if e.created >= cutoff)

    async def sweep(self) -> int:
        cutoff = self.now() - self.ttl
        stale = [k for k, e in self._d.items() if e.created < cutoff]
        for k in stale:
            del self._d[k]
        self.evicted_stale += len(stale)
        return len(stale)


class RedisStore(ConversationStore):
    """Redis: one key per conversation (``GETDEL`` take, per-key expiry) plus a
    sorted-set index by creation time for the count, the stale sweep and the bound.

    Keys live ``ttl + grace`` seconds in Redis so that a take can still see an
    entry that just went stale and report it (upstream logs those), instead of a
    silent miss.
    """

    kind = "redis"
    GRACE: Final = 60.0

    def __init__(
        self,
        url: str,
        ttl: float,
        max_entries: int,
        now: Callable[[], float] = time.time,
        prefix: str = "bidirkv:",
    ) -> None:
        super().__init__(ttl, max_entries, now)
        from redis import asyncio as aioredis

        self.url = url
        self.prefix = prefix
        self._index = f"{prefix}index"
        self._r: Any = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)

    def _k(self, key: str) -> str:
        return f"{self.prefix}conv:{key}"

    async def _run(self, what: str, coro: Any) -> Any:
        from redis.exceptions import RedisError

        try:
            return await coro
        except (RedisError, OSError) as exc:
            raise StoreError(f"redis store {self.url}: {what} failed: {exc}") from None

    async def ping(self) -> None:
        await self._run("PING", self._r.ping())

    async def take(self, key: str) -> Taken:
        k = self._k(key)
        pipe = self._r.pipeline(transaction=True)
        pipe.getdel(k)
        pipe.zrem(self._index, k)
        raw, _ = await self._run("GETDEL", pipe.execute())
        return self._judge(None if raw is None else Entry.from_bytes(raw))

    async def put(self, key: str, entry: Entry) -> None:
        k = self._k(key)
        pipe = self._r.pipeline(transaction=True)
        pipe.set(k, entry.to_bytes(), px=int((self.ttl + self.GRACE) * 1000))
        pipe.zadd(self._index, {k: entry.created})
        pipe.zcard(self._index)
        *_, count = await self._run("SET", pipe.execute())
        excess = int(count) - self.max_entries
        if excess > 0:
            popped = await self._run("ZPOPMIN", self._r.zpopmin(self._index, excess))
            names = [m for m, _ in popped]
            if names:
                await self._run("DEL", self._r.delete(*names))
                self.evicted_lru += len(names)

    async def size(self) -> int:
        n = await self._run("ZCOUNT", self._r.zcount(self._index, self.now() - self.ttl, "+inf"))
        return int(n)

    async def sweep(self) -> int:
        cutoff = self.now() - self.ttl
        names = await self._run(
            "ZRANGEBYSCORE", self._r.zrangebyscore(self._index, "-inf", f"({cutoff}")
        )
        if not names:
            return 0
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(*names)
        pipe.zrem(self._index, *names)
        await self._run("sweep", pipe.execute())
        self.evicted_stale += len(names)
        return len(names)

    async def close(self) -> None:
        await self._r.aclose()


def open_store(
    spec: str, ttl: float, max_entries: int, now: Callable[[], float] = time.time
) -> ConversationStore:
    """``memory`` or a ``redis://`` / ``rediss://`` / ``unix://`` URL."""
    if spec == "memory":
        return MemoryStore(ttl, max_entries, now)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(spec, ttl, max_entries, now)
    raise ValueError(f"--store must be 'memory' or a redis:// URL, got {spec!r}")
