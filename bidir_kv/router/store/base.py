"""The conversation store's interface and its record: (tenant, conversation) -> D's params.

Entries are single use (a take removes them: two concurrent turns of one
conversation cannot both import the same blocks) and bounded by a TTL kept below
D's ``decoder_kv_blocks_ttl`` and by a maximum count (oldest evicted first).
Whether a taken entry is stale is decided here, once, by
:func:`bidir_kv.policy.entry_is_stale`; implementations only fetch and delete.
"""

from __future__ import annotations

import abc
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import msgpack

from bidir_kv.errors import RouterError
from bidir_kv.policy import entry_age, entry_is_stale
from bidir_kv.protocol import KVTransferParams

__all__ = ["ConversationStore", "Entry", "EvictionHook", "Renewal", "StoreError", "Taken"]

_FORMAT: Final = 1


class StoreError(RouterError, RuntimeError):
    """The store is unreachable or holds something we cannot read."""

    http_status = 503
    error_type = "ServiceUnavailable"


@dataclass(frozen=True, slots=True)
class Entry:
    """What one finished turn leaves behind for the next one.

    ``tokens`` is D's token sequence (prompt + generated ids) when the D leg
    returned token ids; the continuation guard compares the next prompt with it.
    ``decode``/``prefill`` name the upstream engines (``host:port``) for sticky
    routing. Token ids are kept as ``array('I')`` (4 bytes each, not a Python int
    object).
    """

    params: KVTransferParams
    decode: str
    prefill: str | None
    created: float
    tokens: Sequence[int] | None = None
    model: str | None = None  # the turn's ``model``, for a release of an evicted entry
    lease: float | None = None  # idle seconds (renewable lease); None: fixed TTL only

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
                "m": self.model,
                "l": self.lease,
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
                model=obj["m"] if isinstance(obj.get("m"), str) else None,
                lease=float(obj["l"]) if isinstance(obj.get("l"), int | float) else None,
            )
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
            raise StoreError(f"unreadable conversation entry: {exc}") from None


# Called with an entry dropped unused and why; must not block (it queues work).
EvictionHook = Callable[[Entry, str], object]


@dataclass(frozen=True, slots=True)
class Taken:
    """Result of a take: the entry if fresh; ``stale`` with its age if it had expired."""

    entry: Entry | None
    stale: bool = False
    age: float = 0.0
    matched: int | None = None  # take_first: the position of the key it was found under


@dataclass(frozen=True, slots=True)
class Renewal:
    """A keep-alive's outcome for a known, fresh entry: its lease (``None``: the entry
    has none, only the fixed TTL) and the new deadline (wall-clock seconds)."""

    lease: float | None
    deadline: float | None


class ConversationStore(abc.ABC):
    """Async store interface; ``ttl`` in seconds, ``now`` is wall-clock seconds.

    Implementations provide :meth:`_pop` (remove and return, atomically) and the
    other abstract methods; :meth:`take` judges what :meth:`_pop` returned.
    Every entry dropped without being used (bound, stale, overwritten) is handed to
    :attr:`on_evict` with the reason, so the router can free D's blocks at once.
    """

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
        self.on_evict: EvictionHook | None = None

    def _evicted(self, entries: Iterable[Entry | None], reason: str) -> None:
        """Report entries dropped unused (``reason``: ``evicted``, ``stale``, ``replaced``)."""
        if self.on_evict is None:
            return
        for entry in entries:
            if entry is not None:
                self.on_evict(entry, reason)

    async def take(self, key: str) -> Taken:
        """Remove and return the entry (single use); a stale one comes back as ``stale``.
        The key is marked as having a turn in flight until that turn's :meth:`put` (or
        the store's TTL), so a close meanwhile is remembered (:meth:`end`)."""
        entry = await self._pop(key, turn=True)
        if entry is None:
            return Taken(None)
        now = self.now()
        age = entry_age(entry.created, now)
        if entry_is_stale(entry.created, now, self.ttl):
            self.evicted_stale += 1
            self._evicted([entry], "stale")
            return Taken(None, stale=True, age=age)
        return Taken(entry, age=age)

    async def take_first(self, keys: Sequence[str]) -> Taken:
        """The entry indexed under the first of ``keys`` that names a stored one
        (:meth:`put`'s ``index``), removed with every index key pointing at it, so no
        other key can hand it out again; judged as :meth:`take` judges. Keys whose entry
        is gone are skipped. (A history turn, never closed: no in-flight mark.)"""
        found = await self._pop_first(keys)
        if found is None:
            return Taken(None)
        matched, entry = found
        now = self.now()
        age = entry_age(entry.created, now)
        if entry_is_stale(entry.created, now, self.ttl):
            self.evicted_stale += 1
            self._evicted([entry], "stale")
            return Taken(None, stale=True, age=age, matched=matched)
        return Taken(entry, age=age, matched=matched)

    @abc.abstractmethod
    async def _pop_first(self, keys: Sequence[str]) -> tuple[int, Entry] | None:
        """Atomically: the first of ``keys`` whose index entry names a stored entry,
        that entry removed with all its index keys; ``(position, entry)``."""

    @abc.abstractmethod
    async def _pop(self, key: str, turn: bool = False) -> Entry | None:
        """Remove and return the entry for ``key``, fresh or not; with ``turn``, mark
        ``key`` as having a turn in flight (cleared by :meth:`put`)."""

    @abc.abstractmethod
    async def put(
        self, key: str, entry: Entry, since: float | None = None, index: Sequence[str] = ()
    ) -> bool:
        """Store (overwrite) the entry for ``key``, unless the conversation was closed
        at or after ``since`` (the storing turn's start, store clock): then store
        nothing and return False (the caller frees the entry's blocks). A close
        always wins over a turn that was in flight when it came. ``index``: keys
        :meth:`take_first` finds it under (an index key already naming another entry
        is moved to this one: the newest turn wins it)."""

    @abc.abstractmethod
    async def size(self) -> int:
        """Number of live (non-stale) entries."""

    @abc.abstractmethod
    async def sweep(self) -> int:
        """Drop stale entries; return how many."""

    # ---- the renewable lease (policy.conversation_lease) ----------------------------

    @abc.abstractmethod
    async def renew(self, key: str) -> Renewal | None:
        """Keep-alive: push a leased entry's deadline to now + its lease; ``None`` when
        there is no fresh entry for ``key`` (unknown, taken, closed, expired, stale)."""

    @abc.abstractmethod
    async def expire_leases(self) -> int:
        """Drop entries whose lease has passed (reported as ``lease_expired``); how many."""

    async def end(self, key: str) -> bool:
        """Close a conversation: drop its entry now (reported as ``closed``, so D's
        blocks are freed) and leave a tombstone, so that a turn in flight stores no
        new entry (:meth:`put`); False when there was neither an entry nor a turn."""
        entry, in_flight = await self._close(key)
        self._evicted([entry], "closed")
        return entry is not None or in_flight

    @abc.abstractmethod
    async def _close(self, key: str) -> tuple[Entry | None, bool]:
        """Atomically: pop the entry, record the close (now), and say whether a turn
        of ``key`` is in flight."""

    async def ping(self) -> None:  # noqa: B027 - optional hook, nothing to check in memory
        """Raise :class:`StoreError` when the store is unreachable."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
