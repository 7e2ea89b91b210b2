"""KV cache groups: which of D's blocks a reuse of a prefix needs, group by group.

vLLM's hybrid KV cache manager (on by default for connectors that support it since
vLLM PR #41847) keeps one block table per KV cache group, and D's ``remote_block_ids``
holds one list per group, in group order (docs/protocol.md §6.4):

* **full attention**: one block per position from token 0, ``[0, nb)``;
* **sliding window** of ``W`` tokens: vLLM frees every block whose tokens all left the
  window and puts its null block (id 0) in the table instead
  (``SlidingWindowManager.get_num_skipped_tokens``); the NIXL connector then exports
  only the last ``cdiv(W, bs) + 1`` entries (``blocks_per_sw``; HMA support in the NIXL
  connector, vLLM PR #35758), null entries first. The list covers block positions
  ``[nb - len, nb)``.

Groups are model-derived and in any order: a 5:1 sliding/full model of 48 layers has
six groups of eight layers, the full-attention one last.

Every list ends at the same block index ``nb``: each group allocates a slot for every
token the request computed. A reuse of the first ``T`` tokens needs, in a full group,
blocks ``[0, cdiv(T, bs))``; in a sliding-window group only the blocks the window of the
next token still sees, ``[floor((T - W + 1) / bs), cdiv(T, bs))`` (vLLM's own prefix
cache asks the same of a hit, ``SlidingWindowManager.find_longest_cache_hit``). A
sliding-window group whose needed blocks D no longer holds cannot be reused at that
length, nor at any shorter one (the window only moves further from what D kept), so the
reuse is refused with a named reason: KV of other tokens is never imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from bidir_kv.policy.blocks import cdiv

__all__ = [
    "NULL_BLOCK",
    "GroupKind",
    "GroupRefusal",
    "GroupTrim",
    "KVGroup",
    "exported_window_blocks",
    "trim_groups",
    "window_block_range",
]

NULL_BLOCK = 0  # vLLM's BlockPool.null_block; the emulator reserves block 0 the same way


class GroupKind(StrEnum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"


class GroupRefusal(StrEnum):
    """Why D's groups cannot be cut to a prefix; each is a log and metric reason."""

    UNKNOWN_LAYOUT = "unknown-group-layout"  # several groups, nobody said which is which
    LAYOUT_MISMATCH = "group-layout-mismatch"  # the layout names another number of groups
    BLOCK_SIZE = "group-block-size"  # a group's block size is not the chain's
    UNTRIMMABLE = "untrimmable-group"  # a kind we cannot cut (Mamba, MLA, ...)
    NO_FULL_GROUP = "no-full-attention-group"  # nothing anchors where the lists end
    RAGGED = "ragged-groups"  # full-attention lists of different lengths
    BEYOND_HELD = "beyond-held-blocks"  # the prefix runs past D's lists
    WINDOW_RELEASED = "sliding-window-released"  # D freed blocks the window needs
    NOTHING = "no-whole-block"  # the prefix holds no whole block


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group: its attention kind, block size and (sliding) window."""

    kind: str
    block_size: int
    window: int | None = None  # tokens; sliding-window groups only

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        sliding = self.kind == GroupKind.SLIDING_WINDOW
        if sliding and (self.window is None or self.window <= 0):
            raise ValueError(f"a sliding-window group needs a positive window, got {self.window}")
        if not sliding and self.window is not None:
            raise ValueError(f"a {self.kind} group has no window")

    @classmethod
    def full(cls, block_size: int) -> KVGroup:
        return cls(GroupKind.FULL, block_size)

    @classmethod
    def sliding(cls, window: int, block_size: int) -> KVGroup:
        return cls(GroupKind.SLIDING_WINDOW, block_size, window)


def exported_window_blocks(window: int, block_size: int) -> int:
    """How many entries vLLM's connector exports for a sliding-window group:
    ``cdiv(W, bs) + 1`` (one more than the window spans, for a window not aligned
    with blocks)."""
    return cdiv(window, block_size) + 1


def window_block_range(end_tokens: int, window: int, block_size: int) -> range:
    """Blocks a sliding-window group must hold so computing can go on at position
    ``end_tokens``: the window of that next token sees positions
    ``[end - W + 1, end)`` of the history."""
    if end_tokens < 0:
        raise ValueError(f"end_tokens must be >= 0, got {end_tokens}")
    first = max(0, end_tokens - window + 1)
    if first >= end_tokens:  # a window of one token sees no history
        return range(0)
    return range(first // block_size, cdiv(end_tokens, block_size))


@dataclass(frozen=True, slots=True)
class GroupTrim:
    """D's lists cut to end where a reuse of ``tokens`` ends (``block_ids``), or the
    reason no cut is safe (``block_ids`` is ``None``)."""

    block_ids: list[list[int]] | None
    tokens: int
    reason: str

    @property
    def ok(self) -> bool:
        return self.block_ids is not None


def _refuse(reason: GroupRefusal) -> GroupTrim:
    return GroupTrim(None, 0, str(reason))


def trim_groups(
    block_ids: Sequence[Sequence[int]],
    tokens: int,
    block_size: int,
    layout: Sequence[KVGroup] | None = None,
    *,
    null_block: int = NULL_BLOCK,
) -> GroupTrim:
    """D's per-group lists for a reuse of the first ``tokens`` tokens.

    ``tokens`` ends at a block boundary (a router's trim) or anywhere (a reader's pull,
    whose last block may be partial): every list is cut to end at block
    ``cdiv(tokens, bs)``. A full group keeps ``[0, end)``; a sliding-window group keeps
    the ``min(cdiv(W, bs) + 1, end)`` entries before ``end``, as D would have exported
    had its sequence ended there, with ``null_block`` for the entries D had already
    freed. ``layout`` is ``None`` when D did not describe its groups: one group is then
    taken as full attention (vLLM's only layout before hybrid models), several are
    refused (:attr:`GroupRefusal.UNKNOWN_LAYOUT`).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    groups = [list(g) for g in block_ids]
    if layout is None:
        if len(groups) != 1:
            return _refuse(GroupRefusal.UNKNOWN_LAYOUT)
        layout = (KVGroup.full(block_size),)
    if len(layout) != len(groups):
        return _refuse(GroupRefusal.LAYOUT_MISMATCH)
    if any(g.block_size != block_size for g in layout):
        return _refuse(GroupRefusal.BLOCK_SIZE)
    if any(g.kind not in (GroupKind.FULL, GroupKind.SLIDING_WINDOW) for g in layout):
        return _refuse(GroupRefusal.UNTRIMMABLE)
    full = {len(ids) for ids, g in zip(groups, layout, strict=True) if g.kind == GroupKind.FULL}
    if not full:
        return _refuse(GroupRefusal.NO_FULL_GROUP)
    if len(full) > 1:
        return _refuse(GroupRefusal.RAGGED)
    held_end = full.pop()  # every list ends here (block index)
    end = cdiv(tokens, block_size)
    if end == 0:
        return _refuse(GroupRefusal.NOTHING)
    if end > held_end:
        return _refuse(GroupRefusal.BEYOND_HELD)
    out: list[list[int]] = []
    for ids, g in zip(groups, layout, strict=True):
        if g.kind == GroupKind.FULL:
            out.append(ids[:end])
            continue
        assert g.window is not None
        start = held_end - len(ids)  # the block index of the list's first entry
        if start < 0:
            return _refuse(GroupRefusal.RAGGED)
        needed = window_block_range(tokens, g.window, block_size)
        if any(i < start or ids[i - start] == null_block for i in needed):
            return _refuse(GroupRefusal.WINDOW_RELEASED)
        keep = min(exported_window_blocks(g.window, block_size), end)
        out.append([ids[i - start] if i >= start else null_block for i in range(end - keep, end)])
    return GroupTrim(out, tokens, "trimmed")
