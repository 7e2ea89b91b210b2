"""D's fence words: one 64-bit generation word per exported retained turn.

The words live in one ``uint64`` array that the transport registers beside the KV
pool, so a reader can READ a word one-sidedly after its block READ
(docs/connector.md §5, "The fence"; wire keys in :mod:`bidir_kv.wire.fence`). D takes a
slot when it retains a turn for a fence-checking reader and writes a fresh value
into it *before* the turn's blocks go back to the free list, unless the release is
the reader's own completion notification (the read is over by then). Freed slots
are reused last (FIFO), so a reader that checks its word just after notifying sees
its own value, not the next turn's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

from bidir_kv.wire.fence import BUDGET_CONFIG_KEY, FENCE_CONFIG_KEY, parse_budget

__all__ = ["DEFAULT_FENCE_SLOTS", "FenceTable", "fence_enabled", "retention_budget"]

logger = logging.getLogger("bidir_kv.engine")

DEFAULT_FENCE_SLOTS = 4096  # 32 KiB of registered words; more retained turns go unfenced


class FenceTable:
    """Slots of generation words; values are unique per process start and slot use."""

    def __init__(self, slots: int = DEFAULT_FENCE_SLOTS) -> None:
        if slots <= 0:
            raise ValueError(f"a fence table needs slots, got {slots}")
        self.words = np.zeros(slots, dtype=np.uint64)
        self._free: deque[int] = deque(range(slots))
        self._slot_of: dict[str, int] = {}
        # starts at the clock so a restarted engine never repeats a (slot, gen) pair
        self._next = time.time_ns() // 1_000_000 << 16

    @property
    def num_slots(self) -> int:
        return int(self.words.shape[0])

    def export(self, request_id: str) -> tuple[int, int] | None:
        """A slot and its current value for ``request_id``; ``None`` when all are taken."""
        if request_id in self._slot_of:
            slot = self._slot_of[request_id]
            return slot, int(self.words[slot])
        if not self._free:
            return None
        slot = self._free.popleft()
        gen = self._advance(slot)
        self._slot_of[request_id] = slot
        return slot, gen

    def is_fenced(self, request_id: str) -> bool:
        return request_id in self._slot_of

    def bump(self, request_id: str) -> bool:
        """Invalidate the turn's word (call before its blocks can be reused); frees the slot."""
        slot = self._slot_of.pop(request_id, None)
        if slot is None:
            return False
        self._advance(slot)
        self._free.append(slot)
        return True

    def done(self, request_id: str) -> None:
        """The reader finished (its notification): free the slot, value unchanged."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def word(self, slot: int) -> int:
        return int(self.words[slot])

    def _advance(self, slot: int) -> int:
        self._next += 1
        self.words[slot] = np.uint64(self._next)
        return self._next


def fence_enabled(extra: Mapping[str, Any], *, pinned: bool) -> bool:
    """Whether this engine speaks the fence (``bidir_kv_fence``, default true).

    ``pinned`` (``--retained-blocks pin``, vLLM's behaviour) turns it off: D then
    releases nothing early, so it needs no fence and the wire stays vLLM's. A value
    that is not a boolean is one warning and no fence (stock behaviour)."""
    enabled = extra.get(FENCE_CONFIG_KEY, True)
    if not isinstance(enabled, bool):
        logger.warning(
            "kv_connector_extra_config.%s must be true or false, got %r; running "
            "without the fence (stock behaviour)",
            FENCE_CONFIG_KEY,
            enabled,
        )
        return False
    return enabled and not pinned


def retention_budget(extra: Mapping[str, Any], *, pinned: bool) -> float | None:
    """D's retention budget (``bidir_kv_retention_budget``; ``None``: none). A value
    outside (0, 1] is one warning and no budget (stock behaviour)."""
    budget, problem = parse_budget(extra.get(BUDGET_CONFIG_KEY))
    if problem:
        logger.warning("%s", problem)
    return None if pinned else budget
