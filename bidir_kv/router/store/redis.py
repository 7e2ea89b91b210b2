"""Redis conversation store: several router replicas, and restarts, share the hits.

Redis's ``GETDEL`` makes the single-use take atomic across replicas.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final

from bidir_kv.policy import stale_cutoff
from bidir_kv.router.store.base import ConversationStore, Entry, StoreError

__all__ = ["RedisStore"]


class RedisStore(ConversationStore):
    """One key per conversation (``GETDEL`` take, per-key expiry) plus a sorted-set
    index by creation time for the count, the stale sweep and the bound.

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
        max_connections: int = 128,
        wait_timeout: float = 5.0,
    ) -> None:
        super().__init__(ttl, max_entries, now)
        from redis import asyncio as aioredis

        self.url = url
        self.prefix = prefix
        self._index = f"{prefix}index"
        # Bounded and blocking: a request beyond ``max_connections`` waits (up to
        # ``wait_timeout``) for a free connection; redis-py's default pool raises
        # "Too many connections" past 100 instead.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=wait_timeout,
            socket_timeout=5, socket_connect_timeout=5,
        )
        self._redis: Any = aioredis.Redis(connection_pool=pool)

    def _key(self, key: str) -> str:
        return f"{self.prefix}conv:{key}"

    async def _run(self, what: str, coro: Any) -> Any:
        from redis.exceptions import RedisError

        try:
            return await coro
        except (RedisError, OSError) as exc:
            raise StoreError(f"redis store {self.url}: {what} failed: {exc}") from None

    async def ping(self) -> None:
        await self._run("PING", self._redis.ping())

    async def _pop(self, key: str) -> Entry | None:
        name = self._key(key)
        pipe = self._redis.pipeline(transaction=True)
        pipe.getdel(name)
        pipe.zrem(self._index, name)
        raw, _ = await self._run("GETDEL", pipe.execute())
        return None if raw is None else Entry.from_bytes(raw)

    async def put(self, key: str, entry: Entry) -> None:
        name = self._key(key)
        pipe = self._redis.pipeline(transaction=True)
        # GET: an entry this one overwrites (concurrent turns of one conversation) is
        # reported, so its blocks on D are released
        pipe.set(name, entry.to_bytes(), px=int((self.ttl + self.GRACE) * 1000), get=True)
        pipe.zadd(self._index, {name: entry.created})
        pipe.zcard(self._index)
        old, _, count = await self._run("SET", pipe.execute())
        self._evicted(self._decode([old]), "replaced")
        excess = int(count) - self.max_entries
        if excess > 0:
            popped = await self._run("ZPOPMIN", self._redis.zpopmin(self._index, excess))
            names = [member for member, _score in popped]
            if names:
                raws = await self._getdel(names)
                self.evicted_lru += len(names)
                self._evicted(self._decode(raws), "evicted")

    async def _getdel(self, names: list[Any]) -> list[Any]:
        pipe = self._redis.pipeline(transaction=True)
        for name in names:
            pipe.getdel(name)
        return list(await self._run("GETDEL", pipe.execute()))

    @staticmethod
    def _decode(raws: list[Any]) -> list[Entry | None]:
        """Entries of raw values; ``None`` for missing ones, unreadable ones skipped."""
        out: list[Entry | None] = []
        for raw in raws:
            if raw is None:
                continue
            try:
                out.append(Entry.from_bytes(raw))
            except StoreError:
                continue
        return out

    async def size(self) -> int:
        cutoff = stale_cutoff(self.now(), self.ttl)  # fresh: created at or after the cutoff
        live = await self._run("ZCOUNT", self._redis.zcount(self._index, cutoff, "+inf"))
        return int(live)

    async def sweep(self) -> int:
        cutoff = stale_cutoff(self.now(), self.ttl)  # stale: created strictly before it
        names = await self._run(
            "ZRANGEBYSCORE", self._redis.zrangebyscore(self._index, "-inf", f"({cutoff}")
        )
        if not names:
            return 0
        pipe = self._redis.pipeline(transaction=True)
        for name in names:
            pipe.getdel(name)
        pipe.zrem(self._index, *names)
        *raws, _ = await self._run("sweep", pipe.execute())
        self.evicted_stale += len(names)
        self._evicted(self._decode(raws), "stale")
        return len(names)

    async def close(self) -> None:
        await self._redis.aclose()
        await self._redis.connection_pool.disconnect()
