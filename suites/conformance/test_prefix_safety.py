"""Prefix safety: no output may differ from recompute (docs/protocol.md §6.3, §7.4 #3).

vLLM does not compare P's prompt with the tokens D holds; it pairs blocks by suffix
trimming. Three ways a next turn stops being a token-exact continuation of D's
sequence, each arranged so that P *does* pull (count >= threshold):

* rewritten history: the last assistant answer is edited;
* stripped reasoning: the first half of the answer ("thinking") is dropped
  (vLLM issue #43094; guard proposed in vLLM PR #44838);
* shorter prompt: the client branches from an earlier point, so D's sequence is
  longer than P's prompt and suffix trimming takes D's *last* blocks.

Direct P/D (no router) is what these pin; through our router the guard must make
them safe (see test_oracle.py).
"""

from __future__ import annotations

import pytest

from bidir_kv.client import PDTurn, run_pd_turn
from bidir_kv.testing.backends import PDBackend, PromptFactory
from bidir_kv.testing.scenario import evidence

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
