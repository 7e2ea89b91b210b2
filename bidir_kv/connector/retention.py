"""D's retained turns as the connector's scheduler sees them: fence slots, the budget,
and which turns to release first. Pure (no vLLM), so it is unit-tested anywhere.

The words themselves live in the worker's registered memory
(:mod:`bidir_kv.connector.worker`); the scheduler only chooses slots and values and
sends them in its connector metadata (docs/connector.md §5.4).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from bidir_kv.policy import retention_budget_blocks

__all__ = ["BUMP_BIT", "FENCE_SLOTS", "RetainedTurns", "Turn"]

FENCE_SLOTS = 4096  # fence words per D worker (32 KiB); more retained turns go unfenced

# The worker bumps a word by setting this bit: the scheduler's values (milliseconds of
# the clock << 16, then counting up) stay below it, so a bumped value never equals one
# the scheduler exported.
BUMP_BIT = 1 << 63


@dataclass
class Turn:
    request_id: str
    blocks: int
    slot: int | None  # None: unfenced (kept to the notification or the TTL)


class RetainedTurns:
    """Retained turns in retention order, with fence slots for the fenced ones."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._free: deque[int] = deque(range(slots))
        self._turns: OrderedDict[str, Turn] = OrderedDict()
        self._next = time.time_ns() // 1_000_000 << 16

    def retain(self, request_id: str, blocks: int, *, fenced: bool) -> tuple[int, int] | None:
        """Track a retained turn; ``(slot, gen)`` when it is fenced and a slot is free."""
        word: tuple[int, int] | None = None
        if fenced and self._free:
            self._next += 1
            word = (self._free.popleft(), self._next)
        self._turns[request_id] = Turn(request_id, blocks, word[0] if word else None)
        return word

    def finished(self, request_id: str) -> None:
        """The worker reported the turn done sending (notified, expired or released)."""
        turn = self._turns.pop(request_id, None)
        if turn is not None and turn.slot is not None:
            self._free.append(turn.slot)  # reused last

    def held_blocks(self) -> int:
        return sum(t.blocks for t in self._turns.values())

    def is_fenced(self, request_id: str) -> bool:
        turn = self._turns.get(request_id)
        return turn is not None and turn.slot is not None

    def over_budget(
        self,
        budget: float,
        total_blocks: int,
        *,
        keep: str = "",
        releasing: set[str] | frozenset[str] = frozenset(),
    ) -> list[str]:
        """Oldest fenced turns to release so retained blocks fit the budget (turns
        already ``releasing`` count as gone)."""
        cap = retention_budget_blocks(budget, total_blocks)
        held = sum(t.blocks for t in self._turns.values() if t.request_id not in releasing)
        out = []
        for turn in self._turns.values():
            if held <= cap:
                break
            if turn.slot is None or turn.request_id == keep or turn.request_id in releasing:
                continue
            out.append(turn.request_id)
            held -= turn.blocks
        return out

    def oldest_fenced(self, exclude: set[str] | frozenset[str] = frozenset()) -> str | None:
        for turn in self._turns.values():
            if turn.slot is not None and turn.request_id not in exclude:
                return turn.request_id
        return None
