"""A P with bidirectional transfer off, given D's params (docs/protocol.md §7.4 #2).

Intended behaviour: P ignores D's dict and computes the prompt itself, answering
normally. Suspected upstream defect: the P branch of ``get_num_new_matched_tokens``
does not check whether the feature is on, claims an async load, and the read is
never queued, so the request may wait forever.
"""

from __future__ import annotations

import pytest

from bidir_kv.client import TransportError, run_pd_turn
from bidir_kv.scrape import NIXL_BYTES, TOKENS_BY_SOURCE
from bidir_kv.testing.backends import PDBackend, PromptFactory
from bidir_kv.testing.scenario import ANSWER_WITHIN, complete_watching

GEN = 16


@pytest.mark.timeout(1800)  # a P variant or many turns on a loaded 2-core box
def test_feature_off_p_ignores_d_params(pd: PDBackend, prompts: PromptFactory) -> None:
    t1 = run_pd_turn(pd.prefill, pd.decode, prompts.prompt(3 * pd.block_size + 50), GEN)
    assert t1.d is not None and t1.d.params is not None
    prompt2 = [*t1.sequence, *prompts.tokens(60)]
    with pd.prefill_variant("bidir-off", bidirectional_kv_xfer=False) as p_off:
        before = p_off.metrics()
        resp, peak = complete_watching(
            p_off, prompt2, GEN, t1.d.params.for_prefill_hit(), ANSWER_WITHIN
        )
        delta = p_off.metrics() - before
    if isinstance(resp, TransportError):
        raise AssertionError(
            f"P (feature off) did not answer within {ANSWER_WITHIN:g} s ({resp}); "
            f"queue peaks while waiting: {peak}; bytes moved: {delta.value(NIXL_BYTES)}"
        )
    assert resp.ok, f"P (feature off) failed: {resp.status} {resp.error}"
    assert delta.value(NIXL_BYTES) == 0
    assert delta.value(TOKENS_BY_SOURCE, source="external_kv_transfer") == 0
    # the main P answers for the reference (it is paused while the variant runs)
    assert resp.token_ids == pd.reference(prompt2, GEN).token_ids
