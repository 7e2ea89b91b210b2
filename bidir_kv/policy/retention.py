"""How long KV blocks are held for a peer, and when a reader must decline.

Three timers from vLLM (docs/protocol.md §5, §8):

* D retains a finished turn's blocks until P's completion notification or a
  fixed deadline ``finish + decoder_kv_blocks_ttl`` (never renewed).
  :class:`RetentionLedger` models it; ``renewable=True`` is our opt-in
  improvement (a heartbeat renews, an idle entry lapses).
* P holds its prefilled blocks under a lease of ``kv_lease_duration`` that D's
  heartbeats extend (:class:`LeaseTable`).
* P declines a read when ``now + 5 s >= deadline`` after converting D's
  exported deadline into its own clock (:func:`should_decline`).

All state objects take ``now`` explicitly: they are pure bookkeeping, the
caller owns the clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_DECODER_KV_BLOCKS_TTL",
    "DEFAULT_KV_LEASE_DURATION",
    "EXPIRY_SAFETY_MARGIN",
    "HandshakeSample",
    "LeaseTable",
    "Release",
    "RetentionLedger",
    "clock_offset",
    "deadline_offset",
    "heartbeat_extension",
    "heartbeat_interval",
    "local_deadline",
    "read_window",
    "remote_deadline",
    "retained_eviction_order",
    "retention_budget_blocks",
    "retention_budget_releases",
    "should_decline",
    "valid_lease_duration",
    "valid_retention_ttl",
]

DEFAULT_DECODER_KV_BLOCKS_TTL = 480.0
DEFAULT_KV_LEASE_DURATION = 30
EXPIRY_SAFETY_MARGIN = 5.0  # vLLM's _KV_BLOCKS_EXPIRY_SAFETY_MARGIN; not configurable upstream


@dataclass(frozen=True, slots=True)
class Release:
    """A ledger entry that left the ledger, and why."""

    request_id: str
    blocks: tuple[int, ...]
    reason: str  # "notified" | "expired" | "evicted"
    reads: int  # completion notifications seen before release


@dataclass(slots=True)
class _Held:
    blocks: tuple[int, ...]
    deadline: float
    expected: int
    seen: int = 0
    renew_for: float = 0.0


@dataclass
class RetentionLedger:
    """D-side ledger of finished requests whose blocks are kept for a P read.

    ``notify`` counts completion notifications ``"<id>:<n>"``; the entry is
    released when ``n`` have arrived (heterogeneous TP sends several). ``reap``
    releases every entry whose deadline has passed (vLLM logs ``Releasing expired
    KV blocks for request ...`` and counts ``num_kv_expired_reqs``).
    """

    ttl: float = DEFAULT_DECODER_KV_BLOCKS_TTL
    renewable: bool = False
    _held: dict[str, _Held] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ttl <= 0:
            raise ValueError(f"decoder_kv_blocks_ttl must be positive, got {self.ttl}")

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def retain(self, request_id: str, blocks: Iterable[int], now: float) -> float:
        """Hold ``blocks`` for ``request_id``; return the deadline to export."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} is already retained")
        deadline = now + self.ttl
        self._held[request_id] = _Held(tuple(blocks), deadline, expected=1, renew_for=self.ttl)
        return deadline

    def deadline(self, request_id: str) -> float | None:
        held = self._held.get(request_id)
        return None if held is None else held.deadline

    def blocks(self, request_id: str) -> tuple[int, ...] | None:
        held = self._held.get(request_id)
        return None if held is None else held.blocks

    def is_readable(self, request_id: str, now: float) -> bool:
        """Whether a read of ``request_id`` may be served at ``now`` (held, not lapsed)."""
        held = self._held.get(request_id)
        return held is not None and now < held.deadline

    def notify(self, request_id: str, expected_consumers: int = 1) -> Release | None:
        """Record one completion notification.

        Returns the release once all expected notifications arrived. Raises
        :class:`KeyError` for an unknown id, the case vLLM logs as ``Potentially
        invalid KV blocks for unrecognized request ...``.
        """
        if expected_consumers < 1:
            raise ValueError(f"expected_consumers must be >= 1, got {expected_consumers}")
        held = self._held[request_id]
        held.expected = expected_consumers
        held.seen += 1
        if held.seen < held.expected:
            return None
        del self._held[request_id]
        return Release(request_id, held.blocks, "notified", held.seen)

    def renew(self, request_id: str, now: float) -> float:
        """Opt-in renewal: push the deadline to ``now + ttl`` (never shortens it)."""
        if not self.renewable:
            raise PermissionError(
                "decoder retention is fixed (vLLM never renews it); "
                "construct RetentionLedger(renewable=True) to allow renewal"
            )
        held = self._held[request_id]
        held.deadline = max(held.deadline, now + held.renew_for)
        return held.deadline

    def reap(self, now: float) -> list[Release]:
        """Release every entry with ``now >= deadline``."""
        expired = [rid for rid, h in self._held.items() if now >= h.deadline]
        out = []
        for rid in expired:
            held = self._held.pop(rid)
            out.append(Release(rid, held.blocks, "expired", held.seen))
        return out

    def next_deadline(self) -> float | None:
        return min((h.deadline for h in self._held.values()), default=None)

    def held_blocks(self) -> int:
        """Distinct blocks the held entries pin (shared prefix blocks count once)."""
        return len({b for h in self._held.values() for b in h.blocks})

    def deadlines(self) -> dict[str, float]:
        """Every held request id and its deadline (the eviction order's input)."""
        return {rid: h.deadline for rid, h in self._held.items()}

    def evict(self, request_id: str) -> Release:
        """Release one entry early because its blocks are needed for new work."""
        held = self._held.pop(request_id)
        return Release(request_id, held.blocks, "evicted", held.seen)


def retained_eviction_order(deadlines: dict[str, float], busy: Iterable[str] = ()) -> list[str]:
    """Which retained turns D gives up first when new work needs their blocks.

    Oldest first: with a fixed TTL the earliest deadline is the turn retained
    longest ago, the one least likely to be continued (a conversation's next turn
    usually follows within seconds) and the one closest to expiring anyway. Ids in
    ``busy`` (a read of them is under way) are never evicted. Ties break by id so
    the order is deterministic.
    """
    skip = set(busy)
    live = [(d, rid) for rid, d in deadlines.items() if rid not in skip]
    return [rid for _, rid in sorted(live)]


def retention_budget_blocks(budget: float, usable_blocks: int) -> int:
    """How many of D's ``usable_blocks`` retained turns may hold under a retention
    budget (a share in (0, 1], ``bidir_kv_retention_budget``; docs/connector.md §5).
    Rounded down, so a budget never lets retention take more than its share."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"a retention budget is a share in (0, 1], got {budget}")
    return int(budget * usable_blocks)


def retention_budget_releases(
    held: Mapping[str, Collection[int]],
    candidates: Iterable[str],
    budget: float,
    usable_blocks: int,
    *,
    releasing: Collection[str] = (),
) -> list[str]:
    """Which retained turns D releases early so retained turns fit its retention budget.

    ``held``: every retained turn and the block ids it holds; a block two turns share
    (a prefix one turn's prompt reused) counts once. ``candidates``: the turns D may
    release (fenced, no read it knows of under way, not the turn just retained), in
    release order, oldest first. Turns in ``releasing`` are on their way out already:
    their blocks do not count as held, so a turn is never released for blocks another
    release frees. Candidates are taken in order until the distinct blocks still held
    fit ``retention_budget_blocks(budget, usable_blocks)``; fewer when the candidates
    run out (docs/connector.md §5.3). Both D's (the emulator's owner and our vLLM
    connector's scheduler) call this.
    """
    cap = retention_budget_blocks(budget, usable_blocks)
    live = {rid: frozenset(blocks) for rid, blocks in held.items() if rid not in releasing}
    refs = Counter(b for blocks in live.values() for b in blocks)  # block -> turns holding it
    out: list[str] = []
    for rid in candidates:
        if len(refs) <= cap:
            break
        blocks = live.pop(rid, None)
        if blocks is None:  # not retained, already releasing, or named twice
            continue
        out.append(rid)
        for b in blocks:
            refs[b] -= 1
            if not refs[b]:
                del refs[b]
    return out


def heartbeat_interval(lease_duration: int) -> int:
    """D sends ``HB:<ids>`` every ``kv_lease_duration // 6`` seconds (5 s by default)."""
    if lease_duration <= 0:
        raise ValueError(f"kv_lease_duration must be positive, got {lease_duration}")
    return lease_duration // 6


def heartbeat_extension(lease_duration: int) -> int:
    """Each heartbeat extends a lease to at least ``now + duration * 2 // 3`` (20 s)."""
    if lease_duration <= 0:
        raise ValueError(f"kv_lease_duration must be positive, got {lease_duration}")
    return lease_duration * 2 // 3


@dataclass
class LeaseTable:
    """P-side leases on prefilled blocks awaiting D's read."""

    duration: int = DEFAULT_KV_LEASE_DURATION
    _expiry: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        heartbeat_interval(self.duration)  # validates

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._expiry

    def __len__(self) -> int:
        return len(self._expiry)

    def hold(self, request_id: str, now: float) -> float:
        self._expiry[request_id] = now + self.duration
        return self._expiry[request_id]

    def expiry(self, request_id: str) -> float | None:
        return self._expiry.get(request_id)

    def heartbeat(self, request_ids: Iterable[str], now: float) -> dict[str, float]:
        """Extend the named leases to ``max(old, now + duration*2//3)``; unknown ids are ignored."""
        ext = heartbeat_extension(self.duration)
        out = {}
        for rid in request_ids:
            old = self._expiry.get(rid)
            if old is None:
                continue
            self._expiry[rid] = max(old, now + ext)
            out[rid] = self._expiry[rid]
        return out

    def release(self, request_id: str) -> bool:
        return self._expiry.pop(request_id, None) is not None

    def reap(self, now: float) -> list[str]:
        expired = [rid for rid, exp in self._expiry.items() if now >= exp]
        for rid in expired:
            del self._expiry[rid]
        return expired


@dataclass(frozen=True, slots=True)
class HandshakeSample:
    """One side-channel query: local send/receive times and the peer's clock reading."""

    send: float
    recv: float
    remote_now: float

    @property
    def rtt(self) -> float:
        return self.recv - self.send


def clock_offset(samples: Iterable[HandshakeSample]) -> float:
    """``remote - local`` clock offset from the lowest-RTT sample (vLLM PR #47021)."""
    best: HandshakeSample | None = None
    for s in samples:
        if s.rtt < 0:
            raise ValueError(f"handshake sample has negative RTT: {s}")
        if best is None or s.rtt < best.rtt:
            best = s
    if best is None:
        raise ValueError("clock_offset needs at least one handshake sample")
    return best.remote_now - (best.send + best.recv) / 2


def local_deadline(remote_expiry: float, offset: float) -> float:
    """D's exported deadline expressed on P's clock."""
    return remote_expiry - offset


def should_decline(
    *,
    remote_expiry: float | None,
    offset: float,
    now: float,
    margin: float = EXPIRY_SAFETY_MARGIN,
) -> bool:
    """P's check right before posting a read: ``now + margin >= deadline_local``.

    ``None`` expiry (absent or null on the wire) never declines.
    """
    if remote_expiry is None:
        return False
    return now + margin >= local_deadline(remote_expiry, offset)


def read_window(ttl: float, margin: float = EXPIRY_SAFETY_MARGIN) -> float:
    """Seconds after D retains a turn's blocks during which P may still read them.

    D's deadline is ``retain + ttl`` and P declines once ``now + margin >= deadline``
    (:func:`should_decline`), so on a shared clock a read posted ``gap`` seconds
    after retention is served only while ``gap < ttl - margin``. Planners use it to
    price a TTL: a follow-up turn later than this recomputes.
    """
    if not valid_retention_ttl(ttl):
        raise ValueError(f"decoder_kv_blocks_ttl must be positive, got {ttl}")
    return max(0.0, ttl - margin)


def deadline_offset(remote_expiry: float, retained_at: float, ttl: float) -> float:
    """How far D's exported deadline lies from ``retained_at + ttl`` on our clock: the
    clock offset (or skew) it implies, when D retained the blocks at ``retained_at``."""
    return remote_expiry - (retained_at + ttl)


def remote_deadline(deadline: float, offset: float) -> float:
    """A deadline on our clock expressed on a clock ``offset`` s ahead.

    The inverse of :func:`local_deadline`; the engine's ``clock_skew`` fault uses it
    to export a deadline as a skewed clock would read it.
    """
    return deadline + offset


def valid_retention_ttl(ttl: float) -> bool:
    """``decoder_kv_blocks_ttl`` must be positive (a zero TTL releases at once)."""
    return ttl > 0


def valid_lease_duration(lease_duration: int) -> bool:
    """A lease needs at least one whole heartbeat interval: ``duration // 6 >= 1`` s."""
    return lease_duration > 0 and heartbeat_interval(lease_duration) >= 1
