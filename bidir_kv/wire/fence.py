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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from bidir_kv.wire.versions import FENCE

__all__ = [
    "ALLOWLIST_CONFIG_KEY",
    "BUDGET_CONFIG_KEY",
    "DEFAULT_RETENTION_BUDGET",
    "FAULT_RELEASE_CONFIG_KEY",
    "FENCE_CONFIG_KEY",
    "FENCE_KEY",
    "advertises_fence",
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
