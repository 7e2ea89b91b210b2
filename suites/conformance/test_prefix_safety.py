"""Prefix safety: no output may differ from recompute (docs/protocol.md §6.3, §7.4 #3).

vLLM does not compare P's prompt with the tokens D holds; it pairs blocks by suffix
trimming. Three ways a next turn stops being a token-exact continuation of D's
sequence, each arranged so that P *does* pull (count >= threshold):

* rewritten history: the last assistant answer is edited;
* stripped reasoning: the first half of the answer ("thinking") is dropped
  (vLLM issue #43094; guard proposed in vLLM PR #44838);
* shorter prompt: the client branches from an earlier point, so D's sequence is
  longer than P's prompt and suffix trimming takes D's *last* blocks;
* another conversation's params: a dict D made for another conversation, live
  (forged onto this request) or already read (stale), handed to P with this prompt.

Direct P/D (no router) is what these pin; through our router the guard must make
them safe (see test_oracle.py).
"""

from __future__ import annotations

import pytest

from bidir_kv.client import PDTurn, run_pd_turn
from bidir_kv.testing.backends import PDBackend, PromptFactory
from bidir_kv.testing.scenario import evidence, two_turns

GEN = 16
ANSWER = 64


def _turn1(pd: PDBackend, prompts: PromptFactory, length: int, gen: int = GEN) -> PDTurn:
    t1 = run_pd_turn(pd.prefill, pd.decode, prompts.prompt(length), gen)
    assert t1.d is not None and t1.d.ok and t1.d.params is not None
    return t1


@pytest.mark.parametrize("edit", ["rewritten_history", "stripped_reasoning"])
def test_non_continuation_matches_recompute(
    pd: PDBackend, prompts: PromptFactory, edit: str
) -> None:
    bs = pd.block_size
    first = 2 * bs + 60  # P holds 2 blocks; D offers 60 + ANSWER - 1 more (>= threshold)
    # a long answer makes the mismatched region large: the tiny random model's greedy
    # output is not sensitive to a few wrong KV positions
    t1 = _turn1(pd, prompts, first, ANSWER)
    assert t1.d is not None
    answer = list(t1.d.token_ids)
    if edit == "rewritten_history":
        answer = [*answer[:4], *prompts.tokens(len(answer) - 4)]
    else:
        answer = answer[len(answer) // 2 :]
    prompt2 = [*t1.prompt, *answer, *prompts.tokens(40)]
    t2 = run_pd_turn(pd.prefill, pd.decode, prompt2, GEN, t1.d.params)
    assert t2.p.ok and t2.d is not None and t2.d.ok
    ev = evidence(t2.p_leg.p)
    ref = pd.reference(prompt2, GEN)
    assert t2.d.token_ids == ref.token_ids, (
        f"output differs from recompute after a {edit} turn (P pulled {ev.external} "
        f"tokens from D over a non-continuation)"
    )


def test_shorter_prompt_matches_recompute(pd: PDBackend, prompts: PromptFactory) -> None:
    bs = pd.block_size
    t1 = _turn1(pd, prompts, 7 * bs + 104)  # D holds 8 blocks
    assert t1.d is not None and t1.d.params is not None
    short = 4 * bs + 88  # a branch: a strict prefix of turn 1's prompt
    prompt2 = t1.prompt[:short]
    assert (t1.d.params.remote_num_tokens or 0) > len(prompt2)
    t2 = run_pd_turn(pd.prefill, pd.decode, prompt2, GEN, t1.d.params)
    assert t2.p.ok and t2.d is not None and t2.d.ok
    ev = evidence(t2.p_leg.p)
    assert ev.local_cache_hit == 4 * bs, ev
    ref = pd.reference(prompt2, GEN)
    assert t2.d.token_ids == ref.token_ids, (
        f"output differs from recompute on a shorter prompt (P pulled {ev.external} tokens; "
        "suffix trimming pairs P's block with D's last block)"
    )


def test_another_conversations_params_read_nothing_unverified(
    pd: PDBackend, prompts: PromptFactory
) -> None:
    """P handed the dict D made for conversation A with conversation B's prompt must read
    none of A's KV: its chain proves no token of B's prompt (docs/connector.md §3.3, the
    emulator's claim answer, docs/engine.md). Forged: A's live dict (the turn D retains
    now); stale: A's turn-1 dict, which A's turn 2 already read and D released. Either
    P answers B from its own compute (equal to recompute) or, when it cannot serve the
    dict under ``kv_load_failure_policy: fail``, fails cleanly; never a read. Stock vLLM
    reads whatever the dict names: only a router's guard stands in between upstream
    (the example proxy's, vLLM PR #44838)."""
    bs = pd.block_size
    # A: 3 blocks + 100 tokens, then a second turn that reads turn 1's last 115 tokens
    a1, a2 = two_turns(pd, prompts, 3 * bs + 100, GEN, 40)
    assert a2.d is not None and a2.d.params is not None
    assert evidence(a2.p_leg.p).external > 0, "A's turn 2 should read turn 1 (the control)"
    # B: P caches B's first block, so A's dicts offer P more than it holds (count >= T)
    b1 = _turn1(pd, prompts, bs + 30)
    assert b1.d is not None and b1.d.params is not None
    prompt_b2 = [*b1.sequence, *prompts.tokens(2 * bs + 44)]
    ref = pd.reference(prompt_b2, GEN)
    for label, foreign in (("forged", a2.d.params), ("stale", a1.d.params)):
        assert a1.d is not None
        offered = min(foreign.remote_num_tokens or 0, len(prompt_b2))
        t = run_pd_turn(pd.prefill, pd.decode, prompt_b2, GEN, foreign)
        ev = evidence(t.p_leg.p)
        assert ev.external == 0 and ev.bytes == 0, (
            f"{label} params of another conversation: P read {ev.external} tokens "
            f"({ev.bytes:.0f} bytes) of its KV (the dict offered {offered}; its chain proves "
            "none of this prompt)"
        )
        if t.p.ok:
            assert t.d is not None and t.d.ok, f"{label}: D leg failed: {t.d}"
            assert t.d.token_ids == ref.token_ids, f"{label}: output differs from recompute"
        else:  # a dict P cannot serve, under policy fail: a clean error, not wrong text
            assert t.p.status == 500 and t.p.error is not None, (label, t.p)


@pytest.mark.kv_groups
@pytest.mark.requires_model("kv_groups")
@pytest.mark.parametrize(
    ("cut", "readable"), [("verbatim", True), ("late", True), ("early", False)]
)
def test_hybrid_rewritten_history_reads_only_where_every_group_allows(
    pd: PDBackend, prompts: PromptFactory, cut: str, readable: bool
) -> None:
    """A hybrid model (a sliding window of 256 tokens beside full attention, vLLM's
    hybrid KV cache manager, docs/protocol.md §6.4). D keeps only the last window of the
    sliding layers: a history rewritten inside D's last block can still be read (the
    full group to the cut, the window's blocks there), one rewritten a block earlier
    cannot (D freed the block the window needs there). P reads the verified prefix in
    the first case and nothing in the second (our connector: ``policy.trim_groups`` on
    P's own groups); every answer equals recompute. Stock vLLM reads D's whole history
    whatever the prompt."""
    bs = pd.block_size
    first = 5 * bs + 60  # P caches the prompt's 5 full blocks on turn 1
    t1 = _turn1(pd, prompts, first, 200)
    assert t1.d is not None and t1.d.params is not None
    held = t1.d.params.remote_num_tokens or 0  # first + 199
    window = (t1.d.params.remote_block_ids or [[]])[0]
    assert len(window) == 3, f"expected the sliding group's last 3 blocks first, got {window}"
    end = held // bs * bs  # where D's last, partial block starts
    keep = {"verbatim": held, "late": end + 1, "early": end - bs + 1}[cut] - first
    answer = list(t1.d.token_ids)
    reply = answer if cut == "verbatim" else [*answer[:keep], *prompts.tokens(40)]
    prompt2 = [*t1.prompt, *reply, *prompts.tokens(30)]
    reads = {"verbatim": held, "late": end, "early": end - bs}[cut] - 5 * bs
    t2 = run_pd_turn(pd.prefill, pd.decode, prompt2, GEN, t1.d.params)
    assert t2.p.ok and t2.d is not None and t2.d.ok, (t2.p.error, t2.d)
    ev = evidence(t2.p_leg.p)
    assert ev.local_cache_hit == 5 * bs, ev
    assert ev.external == (reads if readable else 0), (
        f"{cut} history: P read {ev.external} tokens of D's KV; the verified prefix beyond "
        f"P's own {5 * bs} is {reads}, which every group allows: {readable}"
    )
    assert t2.d.token_ids == pd.reference(prompt2, GEN).token_ids
