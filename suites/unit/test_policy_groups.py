"""Trimming D's per-group block lists to a reused prefix (bidir_kv/policy/groups.py).

The oracle is a model of what vLLM's D exports (docs/protocol.md §6.4): one block table
per group with a block per position, sliding-window blocks whose tokens all left the
window of the last computed step replaced by the null block, then each sliding-window
list clipped to its last ``cdiv(W, bs) + 1`` entries.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bidir_kv.policy import (
    NULL_BLOCK,
    GroupRefusal,
    KVGroup,
    cdiv,
    exported_window_blocks,
    trim_groups,
    window_block_range,
)

BS = 16


def vllm_tables(n: int, layout: list[KVGroup], extra: int = 0) -> list[list[int]]:
    """Every group's whole table (one distinct id per position) at D's finish; sliding
    entries vLLM freed are the null block. vLLM frees at the start of the last step,
    with ``n - 1`` tokens computed: skipped tokens ``(n - 1) - W + 1``. ``extra``: a
    slot already allocated for the next token (async scheduling), a new block only
    when ``n`` fills its last block."""
    ids = itertools.count(1)
    nb = cdiv(n, BS) + (extra if n % BS == 0 else 0)
    out = []
    for g in layout:
        table = [next(ids) for _ in range(nb)]
        if g.window is not None:
            skipped = max(0, (n - 1) - g.window + 1) // BS
            table[:skipped] = [NULL_BLOCK] * skipped
        out.append(table)
    return out


def vllm_export(tables: list[list[int]], layout: list[KVGroup]) -> list[list[int]]:
    """vLLM's ``get_exchange_clipped_blocks``: sliding lists keep their tail."""
    return [
        t[-exported_window_blocks(g.window, BS) :] if g.window is not None else list(t)
        for t, g in zip(tables, layout, strict=True)
    ]


def needed_blocks(tokens: int, window: int) -> set[int]:
    """Blocks holding the positions the next token's window sees (stated by position)."""
    return {p // BS for p in range(max(0, tokens - window + 1), tokens)}


def test_one_group_without_layout_is_full_attention() -> None:
    trim = trim_groups([[7, 8, 9, 10]], 32, BS)
    assert trim.ok and trim.block_ids == [[7, 8]] and trim.tokens == 32
    assert trim_groups([[7, 8, 9, 10]], 33, BS).block_ids == [[7, 8, 9]]  # partial end


@pytest.mark.parametrize(
    ("block_ids", "tokens", "layout", "reason"),
    [
        ([[1, 2], [3, 4]], 16, None, GroupRefusal.UNKNOWN_LAYOUT),
        ([[1, 2]], 16, [KVGroup.full(BS), KVGroup.full(BS)], GroupRefusal.LAYOUT_MISMATCH),
        ([[1, 2]], 16, [KVGroup.full(32)], GroupRefusal.BLOCK_SIZE),
        ([[1, 2]], 16, [KVGroup("mamba", BS)], GroupRefusal.UNTRIMMABLE),
        ([[1, 2]], 16, [KVGroup.sliding(64, BS)], GroupRefusal.NO_FULL_GROUP),
        ([[1, 2], [3]], 16, [KVGroup.full(BS), KVGroup.full(BS)], GroupRefusal.RAGGED),
        ([[1, 2]], 48, None, GroupRefusal.BEYOND_HELD),
        ([[1, 2]], 0, None, GroupRefusal.NOTHING),
        ([[1], [2, 3]], 16, [KVGroup.full(BS), KVGroup.sliding(64, BS)], GroupRefusal.RAGGED),
    ],
)
def test_refusals_are_named(
    block_ids: list[list[int]], tokens: int, layout: list[KVGroup] | None, reason: str
) -> None:
    trim = trim_groups(block_ids, tokens, BS, layout)
    assert not trim.ok and trim.reason == reason and trim.tokens == 0


def test_worked_example_window_held_or_released() -> None:
    """W = 40, bs = 16: D computed 200 tokens (13 blocks); vLLM freed blocks 0-9 (160
    skipped tokens of 199 - 40 + 1), so it exports indices 9-12 (``cdiv(40, 16) + 1 = 4``
    entries), index 9 null."""
    layout = [KVGroup.full(BS), KVGroup.sliding(40, BS)]
    d = vllm_export(vllm_tables(200, layout), layout)
    assert d[1] == [NULL_BLOCK, 24, 25, 26]
    # a reuse of 192 tokens needs blocks 9-11 of the window: 9 is freed
    assert trim_groups(d, 192, BS, layout).reason == GroupRefusal.WINDOW_RELEASED
    # the whole history (a verbatim continuation) and a cut at 200 keep the tail
    whole = trim_groups(d, 200, BS, layout)
    assert whole.ok and whole.block_ids == [list(range(1, 14)), [NULL_BLOCK, 24, 25, 26]]
    # a window of 128 tokens keeps 9 entries: a cut at 192 drops D's last block
    wide = [KVGroup.full(BS), KVGroup.sliding(128, BS)]
    d = vllm_export(vllm_tables(200, wide), wide)
    cut = trim_groups(d, 192, BS, wide)
    assert cut.ok and cut.block_ids == [
        list(range(1, 13)),
        [NULL_BLOCK, 18, 19, 20, 21, *range(22, 26)],
    ]


def test_window_block_range() -> None:
    assert window_block_range(192, 40, BS) == range(9, 12)
    assert window_block_range(200, 40, BS) == range(10, 13)
    assert window_block_range(20, 40, BS) == range(0, 2)  # the window reaches token 0
    assert window_block_range(0, 40, BS) == range(0, 0)
    assert not window_block_range(33, 1, BS)  # a window of one token needs no history


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[KVGroup], int, int, int]:
    windows = draw(st.lists(st.integers(1, 200), min_size=1, max_size=3))
    layout = [KVGroup.sliding(w, BS) for w in windows]
    layout.insert(draw(st.integers(0, len(layout))), KVGroup.full(BS))
    n = draw(st.integers(1, 400))
    extra = draw(st.integers(0, 1))  # a block allocated past the computed tokens
    tokens = draw(st.integers(0, n))
    return layout, n, extra, tokens


@given(cases())
def test_a_trim_is_accepted_exactly_when_d_holds_the_window(
    case: tuple[list[KVGroup], int, int, int],
) -> None:
    """Accepted iff every block the window needs at the cut is one D still holds; the
    cut lists then name, at each needed position, D's block of that position (never
    another token's KV), and look as D's export would had its sequence ended there."""
    layout, n, extra, tokens = case
    tables = vllm_tables(n, layout, extra)
    d = vllm_export(tables, layout)
    trim = trim_groups(d, tokens, BS, layout)
    end = cdiv(tokens, BS)
    exported_from = [len(t) - len(e) for t, e in zip(tables, d, strict=True)]
    held = all(
        i >= start and t[i] != NULL_BLOCK
        for t, g, start in zip(tables, layout, exported_from, strict=True)
        if g.window is not None
        for i in needed_blocks(tokens, g.window)
    )
    if end == 0:
        assert trim.reason == GroupRefusal.NOTHING
        return
    assert trim.ok is held, (trim, d)
    if not trim.ok:
        assert trim.reason == GroupRefusal.WINDOW_RELEASED
        return
    assert trim.block_ids is not None and trim.tokens == tokens
    for t, g, cut in zip(tables, layout, trim.block_ids, strict=True):
        if g.window is None:
            assert cut == t[:end]
            continue
        assert len(cut) == min(exported_window_blocks(g.window, BS), end)
        first = end - len(cut)  # the list ends at the cut, like every other group's
        for i in needed_blocks(tokens, g.window):
            assert cut[i - first] == t[i] != NULL_BLOCK
        assert all(b in (NULL_BLOCK, t[first + j]) for j, b in enumerate(cut))


@given(cases())
def test_the_whole_history_is_always_reusable_and_cuts_are_monotone(
    case: tuple[list[KVGroup], int, int, int],
) -> None:
    """A continuation through all of D's tokens is never refused; a cut that is
    refused stays refused for every shorter cut (the window moves away from D's tail)."""
    layout, n, extra, tokens = case
    d = vllm_export(vllm_tables(n, layout, extra), layout)
    assert trim_groups(d, n, BS, layout).ok
    if tokens and not trim_groups(d, tokens, BS, layout).ok:
        assert not any(trim_groups(d, t, BS, layout).ok for t in range(1, tokens))
