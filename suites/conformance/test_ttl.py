"""D's retention TTL and P's decline near expiry (docs/protocol.md §5; checklist §15.4).

* D releases retained blocks at ``decoder_kv_blocks_ttl`` without a read: WARNING
  ``Releasing expired KV blocks ...`` and ``vllm:nixl_num_kv_expired_reqs`` on D.
* P declines a read when ``now + 5 s >= deadline`` (vLLM PR #47021): WARNING
  ``Declining expired remote read ...``, the expired counter on P, no bytes moved,
  and the outcome follows ``kv_load_failure_policy`` -- never a hang.

The real-time test waits out D's short TTL once. The policy tests move the exported
deadline instead (P's rule reads only that value), each on a pair whose P has the
policy under test (the main pair for ``fail``, the shared small pair for
``recompute``).
"""

from __future__ import annotations

import time

import pytest

from bidir_kv.client import TransportError, run_pd_turn
from bidir_kv.scrape import NIXL_BYTES, NIXL_EXPIRED
from bidir_kv.testing.backends import PDBackend, PromptFactory
from bidir_kv.testing.pairs import SMALL_PAIR_TIMING, small_pair
from bidir_kv.testing.poll import wait_for
from bidir_kv.testing.scenario import (
    ANSWER_WITHIN,
    complete_watching,
    expire_soon,
    wait_metric_increase,
)

GEN = 16
# turn-1 length: P caches 3 blocks, D offers 115 more tokens (>= threshold 64), so P
# has something to read -- the decline check runs only then (notify-only skips it)
FIRST_BLOCKS, FIRST_EXTRA = 3, 100
DECLINE_LOG = "Declining expired remote read for"
RELEASE_LOG = "Releasing expired KV blocks for request"


def _first(pd: PDBackend, prompts: PromptFactory) -> list[int]:
    return prompts.prompt(FIRST_BLOCKS * pd.block_size + FIRST_EXTRA)


def _need_same_clock(pd: PDBackend) -> None:
    if not pd.same_clock:
        pytest.skip(
            "needs the engines' monotonic clock (same host); external deployments "
            "export deadlines on their own clocks"
        )


def test_ttl_expiry_d_releases_and_p_declines(pd: PDBackend, prompts: PromptFactory) -> None:
    _need_same_clock(pd)
    ttl = pd.config.decoder_ttl
    t1 = run_pd_turn(pd.prefill, pd.decode, _first(pd, prompts), GEN)
    assert t1.d is not None and t1.d.params is not None
    d_params = t1.d.params
    expiry = d_params.remote_blocks_expiry_time
    assert expiry is not None
    d_before = pd.decode.metrics()
    d_mark = pd.decode.log_mark()
    # wait until P's rule must decline (now + 5 s >= deadline), but before D's TTL
    wait_for(
        lambda: time.perf_counter() >= expiry - 5.0 + 0.5, ttl, "the decline window", interval=0.2
    )
    p_before = pd.prefill.metrics()
    p_mark = pd.prefill.log_mark()
    prompt2 = [*t1.sequence, *prompts.tokens(50)]
    try:
        resp = pd.prefill.complete(prompt2, 1, d_params.for_prefill_hit(), timeout=60)
    except TransportError as exc:  # no answer within the timeout, or the connection dropped
        pytest.fail(f"P hung or dropped the connection: {exc}")
    p_delta = pd.prefill.metrics() - p_before
    assert p_delta.value(NIXL_BYTES) == 0, "a declined read must move no bytes"
    assert wait_metric_increase(pd.prefill, p_before, NIXL_EXPIRED, 10) == 1
    p_log = pd.prefill.log_since(p_mark)
    if p_log is not None:
        assert DECLINE_LOG in p_log
    # failure policy "fail": the P request ends in an error (HTTP 500)
    assert resp.status == 500, f"policy fail must surface as HTTP 500, got {resp.status}"
    # D was not notified: it releases at its deadline, read by nobody
    rid = str(d_params.remote_request_id)

    def release_line() -> str | None:
        log = pd.decode.log_since(d_mark) or ""
        return next((ln for ln in log.splitlines() if RELEASE_LOG in ln and rid in ln), None)

    if pd.decode.has_log:
        line = wait_for(release_line, ttl + 30, f"D to release {rid} at its TTL", interval=0.2)
        assert "retrieved by 0 remote worker(s)" in line
        assert (pd.decode.metrics() - d_before).value(NIXL_EXPIRED) >= 1
    else:
        wait_metric_increase(pd.decode, d_before, NIXL_EXPIRED, ttl + 30)


@pytest.mark.timeout(1800)  # a pair of its own to start, or many turns on a loaded 2-core box
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_decline_outcome_per_failure_policy(
    pd: PDBackend, prompts: PromptFactory, policy: str
) -> None:
    """What the client of P sees when P declines: ``fail`` -> HTTP 500, ``recompute`` ->
    a normal answer equal to the non-disaggregated output. Never a hang.

    ``fail`` is the main pair's policy; ``recompute`` runs on the backend's small pair,
    whose P and D have it (``bidir_kv.testing.pairs.small_pair``, shared with the
    operational scenarios: no server is started for this test alone)."""
    _need_same_clock(pd)
    assert policy in ("fail", "recompute") and pd.config.failure_policy == "fail"
    pair = None
    if policy == "fail":
        p, d = pd.prefill, pd.decode
    else:
        pair = pd.pair(small_pair(pd.name))
        pair.drain(SMALL_PAIR_TIMING[pd.name].ttl + 30)
        p, d = pair.prefill, pair.decode
    t1 = run_pd_turn(p, d, _first(pd, prompts), GEN)
    assert t1.d is not None and t1.d.params is not None
    if pair is not None:
        pair.held.append(t1.d.params)  # declined below: D keeps it until released
    late = expire_soon(t1.d.params, 2.0)
    prompt2 = [*t1.sequence, *prompts.tokens(50)]
    before = p.metrics()
    resp, peak = complete_watching(p, prompt2, GEN, late.for_prefill_hit(), ANSWER_WITHIN)
    delta = p.metrics() - before
    if isinstance(resp, TransportError):
        raise AssertionError(
            f"P did not answer within {ANSWER_WITHIN:g} s after declining ({resp}); "
            f"queue peaks while waiting: {peak}"
        )
    assert delta.value(NIXL_EXPIRED) == 1, "the decline is counted as an expiry"
    assert delta.value(NIXL_BYTES) == 0
    if policy == "fail":
        assert resp.status == 500
    else:
        assert resp.ok, f"recompute must answer normally: {resp.status} {resp.error}"
        # the non-disaggregated output, computed on the same P from nothing
        salt = f"ref-{time.time_ns()}"
        assert resp.token_ids == p.complete(prompt2, GEN, extra={"cache_salt": salt}).token_ids
