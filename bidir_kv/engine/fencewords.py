"""The emulated D's fence: its generation words in memory, and the retention budget.

The words live in one ``uint64`` array that the transport registers beside the KV
pool, so a reader can READ a word one-sidedly after its block READ (docs/connector.md
§5, "The fence"). Which slot a turn holds, the values and the bump are
:mod:`bidir_kv.wire.fence`'s (:class:`~bidir_kv.wire.fence.FenceSlots`, shared with our
vLLM connector); this module only writes them into the registered array. D writes a
bumped value *before* a turn's blocks go back to the free list, unless the release is
the reader's own completion notification (the read is over by then).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from bidir_kv.wire.fence import FENCE_SLOTS, FenceConfig, FenceSlots, bumped

__all__ = ["FenceTable", "fence_from_config"]

logger = logging.getLogger("bidir_kv.engine")


class FenceTable:
    """D's registered words, and the retention budget that releases fenced turns early
    (the budget never releases an unfenced turn, so without a table it has nothing to do)."""

    def __init__(self, slots: int = FENCE_SLOTS, *, budget: float | None = None) -> None:
        self.slots = FenceSlots(slots)
        self.words = np.zeros(slots, dtype=np.uint64)
        self.budget = budget

    def export(self, request_id: str) -> tuple[int, int] | None:
        """A slot and its value for ``request_id``; ``None`` when all are taken."""
        word = self.slots.export(request_id)
        if word is not None:
            self.words[word[0]] = np.uint64(word[1])
        return word

    def is_fenced(self, request_id: str) -> bool:
        return request_id in self.slots

    def bump(self, request_id: str) -> bool:
        """Invalidate the turn's word (call before its blocks can be reused); frees the slot."""
        slot = self.slots.release(request_id)
        if slot is None:
            return False
        self.words[slot] = np.uint64(bumped(int(self.words[slot])))
        return True

    def done(self, request_id: str) -> None:
        """The reader finished (its notification): free the slot, value unchanged."""
        self.slots.release(request_id)

    def word(self, slot: int) -> int:
        return int(self.words[slot])


def fence_from_config(extra: Mapping[str, Any], *, pinned: bool) -> FenceTable | None:
    """D's fence table when this engine speaks the fence (``bidir_kv_fence``, default
    true), with its retention budget (``bidir_kv_retention_budget``); ``None`` otherwise.

    ``pinned`` (``--retained-blocks pin``, vLLM's behaviour) turns it off: D then
    releases nothing early, so it needs no fence and the wire stays vLLM's. A bad value
    is one warning and stock behaviour for that key."""
    config = FenceConfig.from_extra(extra)
    for problem in config.problems:
        logger.warning("%s", problem)
    if not config.fence or pinned:
        return None
    return FenceTable(budget=config.budget)
