"""Redis conversation store: several router replicas, and restarts, share the hits.

Redis's ``GETDEL`` makes the single-use take atomic across replicas. A history entry is
also found under index keys (``pfx:<key>``, each naming the entry's record) listed in
its ``ixof:<key>``; the take of :meth:`RedisStore.take_first` and every removal drop
them in the same script, so an entry found once is never handed out again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from bidir_kv.policy import lease_deadline, stale_cutoff
from bidir_kv.router.store.base import ConversationStore, Entry, Renewal, StoreError

__all__ = ["RedisStore"]

# Forget a removed record ``name`` everywhere but its own key: the creation index, the
# two lease tables, and its index keys (those still naming it: a newer entry may have
# taken one over) with their list; ``ixof`` prefix and the record prefix's length turn a
# record name into its list's name.
_FORGET = """
local function forget(name, ixof, convlen, index, leases, idle)
  redis.call('ZREM', index, name)
  redis.call('ZREM', leases, name)
  redis.call('HDEL', idle, name)
  local list_key = ixof .. string.sub(name, tonumber(convlen) + 1)
  local list = redis.call('GET', list_key)
  if list then
    for ik in string.gmatch(list, '[^\\n]+') do
      if redis.call('GET', ik) == name then redis.call('DEL', ik) end
    end
    redis.call('DEL', list_key)
  end
end
"""
# The first of KEYS (index keys, longest prefix first) naming a live record: the record
# is removed with its index (ARGV: ixof prefix, record prefix length, the creation index,
# the lease tables); returns {position, record}. A key naming a gone record is deleted.
_TAKE_FIRST = (
    _FORGET
    + """
for i, ik in ipairs(KEYS) do
  local name = redis.call('GET', ik)
  if name then
    local raw = redis.call('GETDEL', name)
    if raw then
      forget(name, ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
      return {i, raw}
    end
    redis.call('DEL', ik)
  end
end
return false
"""
)
# Remove records KEYS (eviction, stale sweep) with their index; returns each record's
# value, '' for a record already gone. ARGV as _TAKE_FIRST's.
_DROP = (
    _FORGET
    + """
local out = {}
for i, name in ipairs(KEYS) do
  local raw = redis.call('GETDEL', name)
  forget(name, ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
  out[i] = raw or ''
end
return out
"""
)

# Keep-alive, atomic: a fresh entry (index score = creation time >= cutoff) with a
# lease gets deadline = now + idle (policy.lease_deadline; ZADD XX never re-adds a
# taken entry). Returns false: no fresh entry; "": no lease; else the idle seconds.
_RENEW = """
local created = redis.call('ZSCORE', KEYS[2], KEYS[1])
if (not created) or tonumber(created) < tonumber(ARGV[2]) then return false end
local idle = redis.call('HGET', KEYS[4], KEYS[1])
if not idle then return '' end
redis.call('ZADD', KEYS[3], 'XX', tonumber(ARGV[1]) + tonumber(idle), KEYS[1])
return idle
"""
# Lease expiry, atomic against keep-alives and takes: every entry whose deadline is
# <= now (policy.lease_expired) is removed with its index and its record returned.
_EXPIRE = (
    _FORGET
    + """
local names = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local out = {}
for _, name in ipairs(names) do
  local raw = redis.call('GETDEL', name)
  forget(name, ARGV[2], ARGV[3], KEYS[2], KEYS[1], KEYS[3])
  if raw then table.insert(out, raw) end
end
return out
"""
)


# Store a turn's entry unless its conversation was closed since the turn began (the
# tombstone KEYS[2] holds the close's time, ARGV[1] the turn's start): the check and
# the write are one step, so a close cannot fall between them. Clears the turn's
# in-flight mark KEYS[3]. KEYS[7] (optional) is the record's index list, KEYS[8..] its
# index keys, each set to name the record. Returns {0} when closed, else {1, old value
# or '', count}.
_PUT = """
local closed = redis.call('GET', KEYS[2])
redis.call('DEL', KEYS[3])
if ARGV[1] ~= '' and closed and tonumber(closed) >= tonumber(ARGV[1]) then return {0} end
local old = redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3], 'GET')
redis.call('ZADD', KEYS[4], ARGV[4], KEYS[1])
if ARGV[5] ~= '' then
  redis.call('ZADD', KEYS[5], ARGV[5], KEYS[1])
  redis.call('HSET', KEYS[6], KEYS[1], ARGV[6])
else
  redis.call('ZREM', KEYS[5], KEYS[1])
  redis.call('HDEL', KEYS[6], KEYS[1])
end
if #KEYS > 7 then
  for i = 8, #KEYS do redis.call('SET', KEYS[i], KEYS[1], 'PX', ARGV[3]) end
  redis.call('SET', KEYS[7], table.concat(KEYS, '\\n', 8), 'PX', ARGV[3])
end
return {1, old or '', redis.call('ZCARD', KEYS[4])}
"""


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
        self._leases = f"{prefix}lease"  # sorted set: entry name -> lease deadline
        self._idle = f"{prefix}leaseidle"  # hash: entry name -> idle seconds
        self._pfx = f"{prefix}pfx:"  # index key -> the record it names (take_first)
        self._ixof = f"{prefix}ixof:"  # a record's index keys, one per line
        # Bounded and blocking: a request beyond ``max_connections`` waits (up to
        # ``wait_timeout``) for a free connection; redis-py's default pool raises
        # "Too many connections" past 100 instead.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=wait_timeout,
            socket_timeout=5,
            socket_connect_timeout=5,
        )
        self._redis: Any = aioredis.Redis(connection_pool=pool)

    def _key(self, key: str) -> str:
        return f"{self.prefix}conv:{key}"

    def _tables(self) -> tuple[str, int, str, str, str]:
        """ARGV of the scripts that remove records: index prefixes, then the tables."""
        return self._ixof, len(self._key("")), self._index, self._leases, self._idle

    async def _pop_first(self, keys: Sequence[str]) -> tuple[int, Entry] | None:
        if not keys:
            return None
        found = await self._run(
            "take",
            self._redis.eval(
                _TAKE_FIRST, len(keys), *[self._pfx + k for k in keys], *self._tables()
            ),
        )
        if not found:
            return None
        return int(found[0]) - 1, Entry.from_bytes(found[1])

    def _marks(self, key: str) -> tuple[str, str]:
        """The tombstone (closed at) and in-flight (a turn took at) keys of ``key``."""
        return f"{self.prefix}closed:{key}", f"{self.prefix}turn:{key}"

    async def _run(self, what: str, coro: Any) -> Any:
        from redis.exceptions import RedisError

        try:
            return await coro
        except (RedisError, OSError) as exc:
            raise StoreError(f"redis store {self.url}: {what} failed: {exc}") from None

    async def ping(self) -> None:
        await self._run("PING", self._redis.ping())

    async def _pop(self, key: str, turn: bool = False) -> Entry | None:
        name = self._key(key)
        pipe = self._redis.pipeline(transaction=True)
        pipe.getdel(name)
        self._forget(pipe, [name])
        if turn:  # marks live as long as an entry may (a turn that stores nothing)
            pipe.set(self._marks(key)[1], repr(self.now()), px=self._mark_ms())
        raw, *_ = await self._run("GETDEL", pipe.execute())
        return None if raw is None else Entry.from_bytes(raw)

    def _mark_ms(self) -> int:
        return int((self.ttl + self.GRACE) * 1000)

    async def _close(self, key: str) -> tuple[Entry | None, bool]:
        name = self._key(key)
        closed, in_flight = self._marks(key)
        pipe = self._redis.pipeline(transaction=True)
        pipe.getdel(name)
        self._forget(pipe, [name])
        pipe.set(closed, repr(self.now()), px=self._mark_ms())
        pipe.exists(in_flight)
        raw, *_, turns = await self._run("close", pipe.execute())
        return self._decode([raw])[0] if raw is not None else None, bool(turns)

    def _forget(self, pipe: Any, names: list[Any]) -> None:
        """Queue removal of ``names`` from the creation index and the lease tables."""
        pipe.zrem(self._index, *names)
        pipe.zrem(self._leases, *names)
        pipe.hdel(self._idle, *names)

    async def put(
        self, key: str, entry: Entry, since: float | None = None, index: Sequence[str] = ()
    ) -> bool:
        name = self._key(key)
        indexed = [self._ixof + key, *(self._pfx + k for k in index)] if index else []
        closed, in_flight = self._marks(key)
        lease = "" if entry.lease is None else repr(lease_deadline(entry.created, entry.lease))
        # the old value: an entry this one overwrites (concurrent turns of one
        # conversation) is reported, so its blocks on D are released
        done = await self._run(
            "SET",
            self._redis.eval(
                _PUT,
                6 + len(indexed),
                name,
                closed,
                in_flight,
                self._index,
                self._leases,
                self._idle,
                *indexed,
                "" if since is None else repr(since),
                entry.to_bytes(),
                str(int((self.ttl + self.GRACE) * 1000)),
                repr(entry.created),
                lease,
                "" if entry.lease is None else repr(entry.lease),
            ),
        )
        if not int(done[0]):
            return False
        old, count = done[1], done[2]
        self._evicted(self._decode([old or None]), "replaced")
        excess = int(count) - self.max_entries
        if excess > 0:
            popped = await self._run("ZPOPMIN", self._redis.zpopmin(self._index, excess))
            names = [member for member, _score in popped]
            if names:
                raws = await self._getdel(names)
                self.evicted_lru += len(names)
                self._evicted(self._decode(raws), "evicted")
        return True

    async def _getdel(self, names: list[Any]) -> list[Any]:
        """Remove records with their index; their values (None: already gone)."""
        raws = await self._run(
            "GETDEL", self._redis.eval(_DROP, len(names), *names, *self._tables())
        )
        return [raw or None for raw in raws]

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
        raws = await self._getdel(names)
        self.evicted_stale += len(names)
        self._evicted(self._decode(raws), "stale")
        return len(names)

    async def renew(self, key: str) -> Renewal | None:
        now = self.now()
        idle = await self._run(
            "keep-alive",
            self._redis.eval(
                _RENEW,
                4,
                self._key(key),
                self._index,
                self._leases,
                self._idle,
                repr(now),
                repr(stale_cutoff(now, self.ttl)),
            ),
        )
        if idle is None:
            return None
        if idle in (b"", ""):
            return Renewal(None, None)
        lease = float(idle)
        return Renewal(lease, lease_deadline(now, lease))

    async def expire_leases(self) -> int:
        raws = await self._run(
            "lease expiry",
            self._redis.eval(
                _EXPIRE,
                3,
                self._leases,
                self._index,
                self._idle,
                repr(self.now()),
                self._ixof,
                len(self._key("")),
            ),
        )
        self._evicted(self._decode(list(raws or [])), "lease_expired")
        return len(raws or [])

    async def close(self) -> None:
        await self._redis.aclose()
        await self._redis.connection_pool.disconnect()
