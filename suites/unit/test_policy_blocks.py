"""Block math and remote/local block pairing (docs/protocol.md §6)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bidir_kv.policy import (
    block_align_down,
    blocks_for_tokens,
    cdiv,
    max_prefix_hit_blocks,
    partial_tail_tokens,
    position_pairing,
    pull_decision,
    suffix_trim_pairing,
    target_block_range,
)


@pytest.mark.parametrize(
    ("a", "b", "q"), [(0, 16, 0), (1, 16, 1), (15, 16, 1), (16, 16, 1), (17, 16, 2), (215, 128, 2)]
)
def test_cdiv(a: int, b: int, q: int) -> None:
    assert cdiv(a, b) == q


@pytest.mark.parametrize(
    ("n", "blocks", "aligned", "tail"),
    [
        (0, 0, 0, 0),
        (1, 1, 0, 1),
        (127, 1, 0, 127),
        (128, 1, 128, 0),
        (129, 2, 128, 1),
        (215, 2, 128, 87),
    ],
)
def test_block_counts_and_partial_tail(n: int, blocks: int, aligned: int, tail: int) -> None:
    assert blocks_for_tokens(n, 128) == blocks
    assert block_align_down(n, 128) == aligned
    assert partial_tail_tokens(n, 128) == tail


@pytest.mark.parametrize("fn", [blocks_for_tokens, block_align_down, partial_tail_tokens])
def test_block_functions_validate(fn) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="block_size"):
        fn(10, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        fn(-1, 16)


def test_target_block_range() -> None:
    assert target_block_range(128, 87, 128) == range(1, 2)  # docs/protocol.md §6.2 example
    assert target_block_range(0, 600, 128) == range(0, 5)
    assert target_block_range(256, 0, 128) == range(2, 2)
    assert target_block_range(0, 1, 16) == range(0, 1)
    with pytest.raises(ValueError, match="block-aligned"):
        target_block_range(130, 10, 128)
    with pytest.raises(ValueError, match="count"):
        target_block_range(0, -1, 128)
    with pytest.raises(ValueError, match="block_size"):
        target_block_range(0, 1, 0)


def test_suffix_trim_pairing_basics() -> None:
    assert suffix_trim_pairing([7, 8], 1) == [8]
    assert suffix_trim_pairing([7, 8], 2) == [7, 8]
    assert suffix_trim_pairing([7, 8], 0) == []
    assert suffix_trim_pairing([], 0) == []
    with pytest.raises(ValueError, match="cannot pair 3 local blocks with 2"):
        suffix_trim_pairing([7, 8], 3)
    with pytest.raises(ValueError, match="num_local_blocks"):
        suffix_trim_pairing([7, 8], -1)


def test_position_pairing_raises_when_remote_is_too_short() -> None:
    with pytest.raises(ValueError, match="needs 3"):
        position_pairing([7, 8], 0, 40, 16)


def test_spec_6_2_example_both_pairings_agree() -> None:
    # D holds 215 tokens in blocks [7, 8]; P hit 128; prompt 516; count 87
    d = pull_decision(
        prompt_tokens=516, local_hit_tokens=128, remote_num_tokens=215, block_size=128
    )
    n = len(target_block_range(d.local_hit_tokens, d.tokens, 128))
    assert n == 1
    assert suffix_trim_pairing([7, 8], n) == position_pairing([7, 8], 128, d.tokens, 128) == [8]


def test_spec_6_3_example_shorter_prompt_misaligns_suffix_trim() -> None:
    # D holds 1000 tokens in 8 blocks; P's prompt is 600 tokens, no local hit
    remote = list(range(100, 108))
    d = pull_decision(
        prompt_tokens=600, local_hit_tokens=0, remote_num_tokens=1000, block_size=128, threshold=0
    )
    assert d.tokens == 600
    n = len(target_block_range(0, d.tokens, 128))
    assert n == 5
    assert suffix_trim_pairing(remote, n) == [103, 104, 105, 106, 107]  # tokens 384-999
    assert position_pairing(remote, 0, d.tokens, 128) == [100, 101, 102, 103, 104]


# ---- properties --------------------------------------------------------------


@given(st.integers(0, 10**6), st.integers(1, 4096))
def test_block_math_identities(n: int, bs: int) -> None:
    assert block_align_down(n, bs) + partial_tail_tokens(n, bs) == n
    assert block_align_down(n, bs) % bs == 0
    assert (blocks_for_tokens(n, bs) - 1) * bs < n <= blocks_for_tokens(n, bs) * bs or n == 0
    assert blocks_for_tokens(n, bs) == block_align_down(n, bs) // bs + (
        1 if partial_tail_tokens(n, bs) else 0
    )


@st.composite
def _pull(draw: st.DrawFn, mode: str = "any") -> tuple[list[int], int, int, int, int]:
    """D's block list for r tokens, a block-aligned local hit h, prompt length L.

    ``mode``: "continuation" makes r <= L; "overshoot" makes D hold a block past
    the prompt's last block; "any" is unconstrained. h < min(r, L) so count > 0.
    """
    bs = draw(st.sampled_from([1, 2, 4, 16, 128]))
    if mode == "continuation":
        r = draw(st.integers(1, 40 * bs))
        length = draw(st.integers(r, 60 * bs))
    elif mode == "overshoot":
        length = draw(st.integers(1, 40 * bs))
        r = draw(st.integers(cdiv(length, bs) * bs + 1, 60 * bs))
    else:
        r = draw(st.integers(1, 40 * bs))
        length = draw(st.integers(1, 60 * bs))
    nblocks = cdiv(r, bs)
    base = draw(st.integers(0, 10**6))
    ids = list(range(base, base + nblocks))  # distinct ids, so any misplacement shows
    if draw(st.booleans()):
        ids.reverse()
    h = draw(st.integers(0, min(r, length) - 1)) // bs * bs
    return ids, r, h, length, bs


@given(_pull())
def test_position_pairing_is_position_correct(case: tuple[list[int], int, int, int, int]) -> None:
    ids, r, h, length, bs = case
    count = min(r, length) - h
    assert count > 0
    pairs = position_pairing(ids, h, count, bs)
    targets = target_block_range(h, count, bs)
    assert len(pairs) == len(targets)
    # each local target block j gets the remote block that holds the same token positions
    for j, remote_id in zip(targets, pairs, strict=True):
        assert remote_id == ids[j]
        first_token = j * bs
        assert h <= first_token + bs - 1 and first_token < h + count
    # every token position P pulls is covered, nothing before the hit is
    covered = {t for j in targets for t in range(j * bs, (j + 1) * bs)}
    assert set(range(h, h + count)) <= covered
    assert min(covered) == h


@given(_pull("continuation"))
def test_suffix_trim_equals_position_pairing_for_continuations(
    case: tuple[list[int], int, int, int, int],
) -> None:
    """vLLM's suffix trim is exactly right when remote_num_tokens <= prompt_len
    (docs/protocol.md §6.2)."""
    ids, r, h, length, bs = case
    assert r <= length
    count = r - h
    n = len(target_block_range(h, count, bs))
    assert suffix_trim_pairing(ids, n) == position_pairing(ids, h, count, bs)


@given(_pull("overshoot"))
def test_suffix_trim_misaligns_when_d_holds_blocks_past_the_prompt(
    case: tuple[list[int], int, int, int, int],
) -> None:
    """r > L with D holding a block beyond the prompt's last one: suffix trim is wrong
    (docs/protocol.md §6.3)."""
    ids, r, h, length, bs = case
    assert cdiv(r, bs) > cdiv(length, bs)
    count = min(r, length) - h
    n = len(target_block_range(h, count, bs))
    assert suffix_trim_pairing(ids, n) != position_pairing(ids, h, count, bs)


@pytest.mark.parametrize(
    ("prompt", "bs", "blocks"), [(1, 16, 0), (16, 16, 0), (17, 16, 1), (33, 16, 2), (32, 16, 1)]
)
def test_a_prefix_hit_never_covers_the_last_prompt_token(prompt: int, bs: int, blocks: int) -> None:
    assert max_prefix_hit_blocks(prompt, bs) == blocks
    assert max_prefix_hit_blocks(prompt, bs) * bs < prompt
    with pytest.raises(ValueError):
        max_prefix_hit_blocks(prompt, 0)
