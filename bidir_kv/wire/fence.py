"""The fence that makes an early release of D's retained blocks safe: wire keys and rules.

Its version and history are in :mod:`bidir_kv.wire.versions` (``FENCE``);
docs/connector.md §5, "The fence". Pure: no I/O, no vLLM, no numpy.

* A reader that checks the fence says so in the dict it hands on with its prefill
  (``do_remote_prefill``): ``"bidir_kv_fence": {"v": 1, "reads": true}``. D
  releases a turn early only when the prefill behind it carried this.
* D exports with a retained turn the slot and value of a 64-bit generation word in
  memory registered with its transport: ``"bidir_kv_fence": {"v": 1, "slot": s,
  "gen": g}`` (plus ``"base"``, the table's address, from our vLLM connector). D
  writes a new value into slot ``s`` *before* the turn's blocks can be reused (any
  release but the one the reader's own completion notification causes).
* The reader READs the word *after* its block READ completes; a word other than
  ``g`` means D may have reused the blocks during the read, so the read is
  discarded and the prompt recomputed.

Every key is ignored by a peer that does not know it (params are read with
``.get``; agent metadata fields are optional), so the rest of the wire stays stock.

Both D's keep their words the same way (:class:`FenceSlots`: which slot a turn holds and
the value written there; :func:`bumped`: the value that invalidates it) and read the
fence's config keys the same way (:class:`FenceConfig`): the emulator's owner
(``engine/fencewords.py``) and our vLLM connector (``connector/fence.py``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bidir_kv.wire.versions import FENCE

__all__ = [
    "ALLOWLIST_CONFIG_KEY",
    "BUDGET_CONFIG_KEY",
    "BUMP_BIT",
    "DEFAULT_RETENTION_BUDGET",
    "FAULT_RELEASE_CONFIG_KEY",
    "FENCE_CONFIG_KEY",
    "FENCE_KEY",
    "FENCE_SLOTS",
    "FenceConfig",
    "FenceSlots",
    "advertises_fence",
    "bumped",
    "parse_budget",
    "reader_advert",
    "word_base",
    "word_of",
    "word_to_wire",
]

# ---- wire ---------------------------------------------------------------------------
FENCE_KEY = "bidir_kv_fence"  # key in kv_transfer_params, both directions

# ---- kv_connector_extra_config keys -----------------------------------------------------
FENCE_CONFIG_KEY = "bidir_kv_fence"  # bool, default true: speak the fence
BUDGET_CONFIG_KEY = "bidir_kv_retention_budget"  # share of D's blocks retained turns may hold
DEFAULT_RETENTION_BUDGET = 1.0  # no cap beyond memory pressure: the published hit rate holds
ALLOWLIST_CONFIG_KEY = "bidir_kv_peer_allowlist"  # engine ids and/or host networks
# fault injection for the conformance tier (our vLLM connector's D): release every fenced
# turn right after exporting it and overwrite its blocks, as a reuse would
FAULT_RELEASE_CONFIG_KEY = "bidir_kv_fault_release_exported"

# ---- D's generation words ---------------------------------------------------------------
FENCE_SLOTS = 4096  # words per D (32 KiB registered beside its KV); more turns go unfenced
# A released turn's word gets this bit: exported values (the clock in milliseconds << 16,
# then counting up) stay below it, so a bumped word never equals a value D exported.
BUMP_BIT = 1 << 63


def bumped(word: int) -> int:
    """What D writes over a released turn's word before its blocks can be reused."""
    return word | BUMP_BIT


class FenceSlots:
    """D's word slots: which one each fenced turn holds and the value exported in it.

    The words themselves live where the transport registered them (a ``uint64`` array
    beside the KV pool); this is the bookkeeping both D's share. A value is never used
    twice: values start at the clock, so a restarted D never repeats a ``(slot, gen)``
    pair, and only grow. A freed slot goes to the back of the free list (reused last),
    so a reader that checks its word just after notifying sees its own value, not the
    next turn's.
    """

    def __init__(self, slots: int = FENCE_SLOTS, *, first_gen: int | None = None) -> None:
        if slots <= 0:
            raise ValueError(f"a fence table needs slots, got {slots}")
        self.num_slots = slots
        self._free: deque[int] = deque(range(slots))
        self._held: dict[str, tuple[int, int]] = {}
        self._gen = time.time_ns() // 1_000_000 << 16 if first_gen is None else first_gen

    def export(self, request_id: str) -> tuple[int, int] | None:
        """``(slot, gen)`` for a retained turn: a free slot and a new value (the same
        pair again for a turn that holds one); ``None`` when every slot is taken."""
        if request_id in self._held:
            return self._held[request_id]
        if not self._free:
            return None
        self._gen += 1
        word = (self._free.popleft(), self._gen)
        self._held[request_id] = word
        return word

    def release(self, request_id: str) -> int | None:
        """Free the turn's slot (reused last); the slot, ``None`` when it held none."""
        word = self._held.pop(request_id, None)
        if word is None:
            return None
        self._free.append(word[0])
        return word[0]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)


@dataclass(frozen=True, slots=True)
class FenceConfig:
    """The fence's keys in ``kv_connector_extra_config``, read the same way by both D's.

    A bad value never stops a start: it is a ``problem`` (the caller logs each once) and
    stock behaviour for that key (docs/connector.md §5.3)."""

    fence: bool = True  # speak the fence: a reader advertises and checks, D exports words
    budget: float | None = None  # share of D's blocks retained turns may hold; None: no cap
    problems: tuple[str, ...] = ()

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> FenceConfig:
        extra = extra or {}
        problems: list[str] = []
        fence = extra.get(FENCE_CONFIG_KEY, True)
        if not isinstance(fence, bool):
            problems.append(
                f"kv_connector_extra_config.{FENCE_CONFIG_KEY} must be true or false, got "
                f"{fence!r}; running without the fence (stock behaviour)"
            )
            fence = False
        budget, problem = parse_budget(extra.get(BUDGET_CONFIG_KEY))
        if problem:
            problems.append(problem)
        return cls(fence=fence, budget=budget, problems=tuple(problems))


def reader_advert() -> dict[str, Any]:
    """What a fence-checking reader adds to the dict it hands on with its prefill."""
    return {"v": FENCE.version, "reads": True}


def advertises_fence(params: Mapping[str, Any] | None) -> bool:
    """Whether ``params`` (a P-node dict) say their reader checks the fence."""
    obj = params.get(FENCE_KEY) if params else None
    return isinstance(obj, Mapping) and obj.get("v") == FENCE.version and obj.get("reads") is True


def word_to_wire(slot: int, gen: int, base: int | None = None) -> dict[str, Any]:
    """The value D adds to a retained turn's dict. ``base``: the address of D's word
    table, for a NIXL reader that prepares the word's descriptor from the params (our
    vLLM connector); the emulator's transports publish it in agent metadata instead."""
    out = {"v": FENCE.version, "slot": int(slot), "gen": int(gen)}
    if base is not None:
        out["base"] = int(base)
    return out


def word_base(params: Mapping[str, Any] | None) -> int | None:
    """The word table's address D put in its dict (``None``: absent or malformed)."""
    obj = params.get(FENCE_KEY) if params else None
    base = obj.get("base") if isinstance(obj, Mapping) else None
    return base if isinstance(base, int) and not isinstance(base, bool) and base > 0 else None


def word_of(params: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """``(slot, gen)`` D exported in a D-node dict; ``None`` when absent, of another
    version or malformed (the read is then unfenced, as with a stock D)."""
    obj = params.get(FENCE_KEY) if params else None
    if not isinstance(obj, Mapping) or obj.get("v") != FENCE.version:
        return None
    slot, gen = obj.get("slot"), obj.get("gen")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (slot, gen)):
        return None
    assert isinstance(slot, int) and isinstance(gen, int)
    if slot < 0 or not 0 < gen < 2**64:
        return None
    return slot, gen


def parse_budget(value: object) -> tuple[float | None, str | None]:
    """``(budget, problem)`` from ``kv_connector_extra_config``: ``(None, None)`` unset,
    ``(None, why)`` for a value outside (0, 1] (the caller logs ``why`` once and runs
    without a budget, as stock vLLM does)."""
    if value is None:
        return None, None
    if isinstance(value, int | float) and not isinstance(value, bool):
        share = float(value)
        if math.isfinite(share) and 0.0 < share <= 1.0:
            return share, None
    return None, (
        f"kv_connector_extra_config.{BUDGET_CONFIG_KEY} must be a share in (0, 1], "
        f"got {value!r}; running without a retention budget (stock behaviour)"
    )
