"""The continuation guard and its hash chain (docs/protocol.md §6.3, vLLM issue #43094,
PR #44838)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bidir_kv.policy import (
    ROOT_HASH,
    block_hashes,
    common_prefix_tokens,
    reusable_prefix,
    reusable_prefix_by_hashes,
    tail_hash,
    verified_continuation,
)

BS = 4


def test_exact_continuation_reuses_all_full_blocks() -> None:
    d = list(range(10))  # D's [prompt | generated] sequence, 2 full blocks + 2 tokens
    prompt = [*d, 100, 101, 102]
    assert reusable_prefix(d, prompt, BS) == 8
    assert reusable_prefix_by_hashes(block_hashes(d, BS), prompt, BS) == 8


def test_mismatch_before_first_block_boundary_gives_zero() -> None:
    d = list(range(12))
    prompt = [0, 1, 99, *range(3, 12)]
    assert reusable_prefix(d, prompt, BS) == 0
    assert reusable_prefix_by_hashes(block_hashes(d, BS), prompt, BS) == 0


def test_stripped_reasoning_in_the_middle_stops_at_the_last_clean_block() -> None:
    # D: [prompt 0..7 | <think> 50 51 52 </think> | answer 60 61 62]
    d = [*range(8), 50, 51, 52, 53, 60, 61, 62]
    # the template re-renders history without the reasoning tokens
    prompt = [*range(8), 60, 61, 62, 70, 71, 72]
    assert reusable_prefix(d, prompt, BS) == 8
    assert reusable_prefix_by_hashes(block_hashes(d, BS), prompt, BS) == 8


def test_shorter_prompt_is_capped_at_its_own_full_blocks() -> None:
    d = list(range(40))
    assert reusable_prefix(d, list(range(22)), BS) == 20
    assert reusable_prefix_by_hashes(block_hashes(d, BS), list(range(22)), BS) == 20


def test_empty_inputs() -> None:
    assert reusable_prefix([], [1, 2, 3, 4], BS) == 0
    assert reusable_prefix([1, 2, 3, 4], [], BS) == 0
    assert block_hashes([], BS) == []
    assert block_hashes([1, 2, 3], BS) == []  # a partial block has no hash
    assert reusable_prefix_by_hashes([], [1, 2, 3, 4], BS) == 0


def test_common_prefix_tokens_long_sequences_use_the_chunked_path() -> None:
    a = list(range(2000))
    b = [*range(1500), -1, *range(1501, 2000)]
    assert common_prefix_tokens(a, b) == 1500
    assert common_prefix_tokens(a, a) == 2000
    assert common_prefix_tokens(a, a[:700]) == 700
    assert common_prefix_tokens((), a) == 0


def test_hash_chain_depends_on_everything_before() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = block_hashes([1, 2, 3, 9, 5, 6, 7, 8], BS)
    assert len(a) == 2 and all(len(h) == 16 for h in a)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 1, different history
    # the block size is part of the hash: [1,2] [3,4] vs [1,2,3,4] never collide by prefix
    assert block_hashes([1, 2, 3, 4], 2)[1] != block_hashes([1, 2, 3, 4], 4)[0]
    # a parent hash continues a chain
    tail = block_hashes([5, 6, 7, 8], BS, parent=a[0])
    assert tail == [a[1]]
    assert block_hashes([1, 2, 3, 4], BS, parent=ROOT_HASH) == a[:1]


def test_hash_chain_validates() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="non-negative"):
        block_hashes([1, -2, 3, 4], BS)
    with pytest.raises(ValueError, match="block_size"):
        reusable_prefix([1], [1], 0)


# ---- properties --------------------------------------------------------------

_tokens = st.lists(st.integers(0, 7), max_size=48)  # small alphabet -> long shared prefixes


@st.composite
def _related(draw: st.DrawFn) -> tuple[list[int], list[int], int]:
    """D's sequence and a prompt that often shares a prefix with it (then diverges)."""
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    d = draw(_tokens)
    keep = draw(st.integers(0, len(d)))
    prompt = d[:keep] + draw(_tokens)
    return d, prompt, bs


@given(_related())
def test_guard_never_approves_a_prefix_that_differs_from_d(
    case: tuple[list[int], list[int], int],
) -> None:
    d, prompt, bs = case
    n = reusable_prefix(d, prompt, bs)
    assert n % bs == 0
    assert 0 <= n <= min(len(d), len(prompt))
    assert prompt[:n] == d[:n]
    # and it is the longest such block-aligned prefix
    nxt = n + bs
    assert nxt > min(len(d), len(prompt)) or prompt[:nxt] != d[:nxt]


@given(_related())
def test_hash_chain_variant_agrees_with_the_token_variant(
    case: tuple[list[int], list[int], int],
) -> None:
    d, prompt, bs = case
    assert reusable_prefix_by_hashes(block_hashes(d, bs), prompt, bs) == reusable_prefix(
        d, prompt, bs
    )


@given(st.lists(st.integers(0, 2**32), max_size=40), st.sampled_from([1, 3, 16]))
def test_hash_chain_is_prefix_stable(tokens: list[int], bs: int) -> None:
    """Appending tokens never changes earlier block hashes (what prefix caching relies on)."""
    full = block_hashes(tokens, bs)
    assert len(full) == len(tokens) // bs
    for cut in range(0, len(tokens) + 1, max(1, bs)):
        assert block_hashes(tokens[:cut], bs) == full[: cut // bs]


def test_reusable_prefix_by_hashes_accepts_the_callers_own_chain() -> None:
    d_tokens = list(range(10, 30))
    prompt = [*d_tokens[:9], 0, *d_tokens[10:]]
    d_chain = block_hashes(d_tokens, BS)
    mine = block_hashes(prompt, BS)
    assert reusable_prefix_by_hashes(d_chain, prompt, BS, prompt_hashes=mine) == 8
    assert reusable_prefix_by_hashes(d_chain, prompt, BS) == 8


def test_verified_continuation_checks_the_owners_partial_tail() -> None:
    """The owner's partial last block counts only when every full block matched and the
    prompt carries the same tail tokens (mutation testing found this unpinned)."""
    owner = list(range(100, 110))  # 2 full blocks of 4 and a tail of 2
    chain, tail = block_hashes(owner, BS), tail_hash(owner[8:10])

    def verified(prompt: list[int]) -> int:
        return verified_continuation(chain, tail, len(owner), prompt, BS)

    assert verified([*owner, 7, 8]) == 10  # continues through the tail
    assert verified(owner) == 10  # exactly the owner's tokens
    assert verified([*owner[:9], 999, 7]) == 8  # the tail differs: full blocks only
    assert verified(owner[:9]) == 8  # the prompt stops inside the tail
    changed_first = [999, *owner[1:], 7]  # same tail tokens, first block differs
    assert verified(changed_first) == 0
    changed_second = [*owner[:5], 999, *owner[6:], 7]
    assert verified(changed_second) == 4
