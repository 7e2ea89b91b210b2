"""Known upstream defects, pinned per conformance scenario, backend and vLLM release.

Each pin becomes ``xfail(strict=True)`` on that backend, for the releases it holds for:
while vLLM has the defect the scenario fails as expected; when a fix lands upstream it
XPASSes, which fails the run, so the pin's range is closed with evidence. Every pin
names the upstream issue or PR (:class:`Upstream`), or, for a defect not filed yet,
carries what a report upstream needs: what, where in vLLM, how to reproduce. Every pin
says which releases it holds for (:class:`Releases`: first and last affected release);
a release outside the range runs the scenario as a plain test.

The range is keyed by release number on purpose: it records where a defect was seen.
Scenarios themselves never branch on version strings; they detect features
(design invariant 14; :mod:`bidir_kv.testing.features`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "DEFECTS",
    "EXEMPTIONS",
    "STREAM_PARAMS",
    "Defect",
    "Exemption",
    "Releases",
    "Upstream",
    "exemption_for",
    "release_key",
]

VLLM_REPO_URL = "https://github.com/vllm-project/vllm"  # where the numbers below live
_RELEASE = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")


def release_key(release: str) -> tuple[int, int, int]:
    """``"0.29.0"`` (or ``"0.29.0+cpu"``, ``"0.29"``) as a tuple that orders releases."""
    m = _RELEASE.match(release.strip())
    if m is None:
        raise ValueError(f"{release!r} is not a vLLM release number like 0.29.0")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@dataclass(frozen=True)
class Releases:
    """The vLLM releases a pin holds for: ``first`` to ``last`` inclusive; ``last``
    ``None`` while no release we run has the fix."""

    first: str
    last: str | None = None

    def __post_init__(self) -> None:
        release_key(self.first)
        if self.last is not None and release_key(self.last) < release_key(self.first):
            raise ValueError(f"release range {self.first}..{self.last} is empty")

    def holds_for(self, release: str | None) -> bool:
        """Whether ``release`` is in the range; ``None`` (a backend that is not a vLLM
        release, e.g. the emulator) is always in it."""
        if release is None:
            return True
        key = release_key(release)
        if key < release_key(self.first):
            return False
        return self.last is None or key <= release_key(self.last)

    def __str__(self) -> str:
        return f"{self.first}-{self.last}" if self.last else f"{self.first} and later (open)"


@dataclass(frozen=True)
class Upstream:
    """The upstream record of a defect: a vLLM issue or PR by number, or none yet."""

    kind: str  # "issue", "pr" or "unfiled"
    number: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("issue", "pr", "unfiled"):
            raise ValueError(f"upstream kind {self.kind!r}: issue, pr or unfiled")
        if (self.number is None) != (self.kind == "unfiled"):
            raise ValueError("an issue or PR has a number; an unfiled defect has none")

    @property
    def label(self) -> str:
        if self.kind == "unfiled":
            return "not filed upstream yet"
        return f"vLLM {'PR' if self.kind == 'pr' else 'issue'} #{self.number}"

    @property
    def url(self) -> str | None:
        if self.number is None:
            return None
        return f"{VLLM_REPO_URL}/{'pull' if self.kind == 'pr' else 'issues'}/{self.number}"


_ALL = Releases("0.0.0")  # a pin of no particular release
UNFILED = Upstream("unfiled")


@dataclass(frozen=True)
class Defect:
    """One upstream defect, shared by every pin that shows it: its upstream record, the
    releases it holds for, what it is and where in vLLM, and (unfiled) how to reproduce
    it. ``key`` names it in the compatibility report."""

    key: str
    upstream: Upstream
    releases: Releases
    what: str
    reproduce: str = ""

    def __post_init__(self) -> None:
        if self.upstream.kind == "unfiled" and not self.reproduce:
            raise ValueError(f"defect {self.key!r} is not filed upstream: say how to reproduce it")


@dataclass(frozen=True)
class Exemption:
    """A scenario that fails on a backend for a known, cited reason."""

    reason: str
    evidence: str
    params: tuple[tuple[str, str], ...] = ()  # only these parametrizations (all if empty)
    defect: Defect | None = None
    families: tuple[str, ...] = ()  # only these model families (all if empty)

    @property
    def upstream(self) -> Upstream:
        return self.defect.upstream if self.defect is not None else UNFILED

    @property
    def releases(self) -> Releases:
        return self.defect.releases if self.defect is not None else _ALL

    @property
    def reproduce(self) -> str:
        return self.defect.reproduce if self.defect is not None else ""

    def matches(
        self,
        params: dict[str, Any],
        release: str | None = None,
        family: str | None = None,
    ) -> bool:
        if not self.releases.holds_for(release):
            return False
        if self.families and family is not None and family not in self.families:
            return False
        return all(_param_id(params.get(k)) == v for k, v in self.params)

    @property
    def xfail_reason(self) -> str:
        """The strict xfail's reason: the upstream record and the range, then why."""
        return f"[{self.upstream.label}; releases {self.releases}] {self.reason}"


# ---- the defects ----------------------------------------------------------------
# Ranges: ``first`` is the earliest release a run here showed the defect on (the
# catalogue ran on 0.21.0, 0.29.0, 0.31.0 and 0.32.0, docs/compat/); ``last`` is the
# release before the fix where one is known, else open. Releases between two runs that
# both show a defect are assumed to have it too (the same code path); the strict xfail
# of the next run there says otherwise.

_RUN = (
    "pytest suites/conformance/{file} -k '{k}' --backend vllm-cpu "
    "--vllm-version <release> --runxfail"
)

STREAM_PARAMS = Defect(
    "stream-params",
    Upstream("pr", 40186),
    Releases("0.21.0", "0.32.0"),
    "D sets kv_transfer_params only on non-streaming responses; a streamed D answer carries "
    "no params on any chunk, so a router that streams D's leg (the upstream example proxy "
    "does) never learns D's retained blocks: every turn misses. vLLM PR #40186 puts them "
    "on the terminal chunk (the finish_reason chunk), in vLLM 0.33.0; the AWS publication "
    "patched 0.29.0 with it.",
)
NO_DECLINE = Defect(
    "expired-read-not-declined",
    Upstream("pr", 47021),
    Releases("0.21.0", "0.25.1"),
    "D exports no deadline (no remote_blocks_expiry_time in its params) and P reads D's "
    "retained blocks however late: a read that starts after D's TTL released them reads "
    "blocks D may have given to another request. vLLM PR #47021 (vLLM 0.26.0) exports D's "
    "deadline and has P decline a read within 5 s of it ('Declining expired remote read').",
)
HANDSHAKE_KILLS_ENGINE = Defect(
    "failed-handshake-kills-engine",
    UNFILED,
    Releases("0.21.0", "0.21.0"),
    "A P whose NIXL handshake with D fails (D gone) dies: the worker's get_finished "
    "post-processes the failed request anyway and looks up the engine it never met "
    "(transfer_topo.get_engine_info(meta.remote.engine_id), KeyError in "
    "vllm/distributed/kv_transfer/kv_connector/v1/nixl/worker.py), the worker fails, the "
    "EngineCore dies (EngineDeadError) and every later request fails, under either failure "
    "policy. vllm-cpu 0.22.0 skips the post-processing of failed requests ('Skipping KV "
    "post-processing for failed request'); the fixing PR's number is not known here.",
    reproduce=_RUN.format(file="test_failure_policy.py", k="unreachable")
    + " -m nightly; by hand: one P->D turn, then send P the turn's D params with "
    "remote_engine_id replaced by an unknown id and remote_port by a closed port: P answers "
    "500 'EngineCore encountered an issue' and serves nothing after.",
)
NON_CONTINUATION = Defect(
    "non-continuation",
    Upstream("issue", 43094),
    Releases("0.21.0"),
    "vLLM compares neither token ids nor block hashes across turns: a next prompt that is "
    "not a token-exact continuation of D's sequence imports KV of other tokens (vLLM issue "
    "#43094; a continuation guard for the example proxy is proposed in vLLM PR #44838).",
)
DECLINE_RECOMPUTE = Defect(
    "decline-recompute-stalls",
    UNFILED,
    Releases("0.31.0"),
    "After P declines a near-expired read (the 5 s margin of vLLM PR #47021), or fails to "
    "reach D at all, under kv_load_failure_policy=recompute (vLLM PR #34896), the request "
    "never runs (0.29.0 recomputed both; 0.31.0 and 0.32.0 stall): the reset "
    "request asks the connector again, the NIXL scheduler's get_num_new_matched_tokens "
    "claims an async load again (vllm/distributed/kv_transfer/kv_connector/v1/nixl, the "
    "pull scheduler), but the read is never queued again (_remote_blocks_processed): the "
    "request stays 'Waiting, Deferred, KV fetch 1 in progress'.",
    reproduce=_RUN.format(file="test_ttl.py", k="decline_outcome and recompute")
    + "; by hand: P with kv_load_failure_policy=recompute, one P->D turn, then send P the "
    "turn's D params with remote_blocks_expiry_time moved to now+2 s: P logs 'Declining "
    "expired remote read' and never answers.",
)
FEATURE_OFF = Defect(
    "feature-off-stalls",
    UNFILED,
    Releases("0.21.0"),
    "A P with bidirectional_kv_xfer off, given D's params, waits forever: the P branch of "
    "get_num_new_matched_tokens (NIXL pull scheduler, vLLM PR #32553) claims an async "
    "load without checking the feature flag; update_state_after_alloc never queues the "
    "read.",
    reproduce=_RUN.format(file="test_feature_off.py", k="feature_off")
    + "; by hand: one P->D turn on a bidirectional pair, then send the turn's D params to a "
    "P started without bidirectional_kv_xfer: no answer, gauges running 0, waiting 1.",
)
SUFFIX_TRIM = Defect(
    "suffix-trim-misaligned",
    UNFILED,
    Releases("0.21.0"),
    "When D's sequence is longer than P's next prompt, suffix trimming "
    "(_apply_prefix_caching on the NIXL pull path of vLLM PR #32553) pairs P's target "
    "block with D's *last* block instead of the block at the same position: P imports KV "
    "of other positions (the upstream test test_remote_blocks_exceed_prompt_tokens checks "
    "scheduler state only).",
    reproduce=_RUN.format(file="test_prefix_safety.py", k="shorter_prompt")
    + "; by hand: turn 1 of 1000 tokens (D holds 1015), then send P only the first 600 "
    "tokens with D's params: P pulls one block from D's end and the greedy output differs "
    "from recompute.",
)
RETENTION_PINS = Defect(
    "retention-pins-memory",
    UNFILED,
    Releases("0.21.0"),
    "D's retained turns hold their blocks until P's notification or the TTL: the NIXL "
    "pull scheduler's request_finished returns delay_free_blocks with "
    "remote_blocks_expiry_time (bidirectional transfer, vLLM PR #32553), and the "
    "scheduler's schedule() leaves a request it cannot allocate in `waiting` (no eviction "
    "of delay-freed blocks, no bound on the wait)",
    reproduce=_RUN.format(file="test_operations.py", k="retained_blocks or queued_request")
    + "; by hand: D with --num-gpu-blocks-override 12, three retained turns of 363 tokens, "
    "then one more request: no answer until the TTL.",
)
SAME_ID_PEER = Defect(
    "same-id-peer-stale",
    UNFILED,
    Releases("0.21.0"),
    "A peer restarted with the same engine id keeps its stale NIXL agent in the reader's "
    "cache: _ensure_handshake returns at once for an engine id in _remote_agents, "
    "_track_remote_engine_replacement reacts only to a different id at an address (the "
    "dead-peer release of vLLM PR #50047, open, also keys on a new id), and failed reads "
    "only mark the engine invalid when its metadata is missing locally",
    reproduce=_RUN.format(file="test_operations.py", k="restarted")
    + "; by hand: a P/D pair, one D->P read, restart D with the same engine id and ports, "
    "then a new conversation: P's reads fail with NIXL_ERR_REMOTE_DISCONNECT for good.",
)
FOREIGN_PARAMS = Defect(
    "foreign-params-imported",
    Upstream("pr", 44838),
    Releases("0.21.0"),
    "P reads whatever blocks a D dict names: handed another conversation's dict (live, or "
    "already read and released by D), P imports that conversation's KV under its own "
    "prompt; nothing in vLLM checks the prompt against D's tokens (issue #43094), and the "
    "only guard upstream is the example proxy's continuation check (vLLM PR #44838, open).",
)
DEFECTS: tuple[Defect, ...] = (
    STREAM_PARAMS,
    NO_DECLINE,
    HANDSHAKE_KILLS_ENGINE,
    NON_CONTINUATION,
    FOREIGN_PARAMS,
    DECLINE_RECOMPUTE,
    FEATURE_OFF,
    SUFFIX_TRIM,
    RETENTION_PINS,
    SAME_ID_PEER,
)

# (scenario test name, backend) -> exemptions. Filled from runs on real vLLM; each
# evidence says what was observed.
_NON_CONTINUATION = Exemption(
    reason="vLLM compares neither token ids nor block hashes across turns: a next prompt "
    "that is not a token-exact continuation of D's sequence imports KV of other tokens "
    "(vLLM issue #43094; continuation guard proposed for the example proxy in vLLM PR "
    "#44838). A router must guard; our bidir-kv proxy does (test_oracle_through_router).",
    evidence="vllm-cpu 0.32.0, 2026-11-30: turn 1 316 tokens + 64 generated; turn 2 with "
    "the answer edited after its 4th token, or its first half stripped: P pulled 123 "
    "tokens from D over the non-continuation and D's greedy output differed from the "
    "non-disaggregated run (from the first token when stripped).",
    defect=NON_CONTINUATION,
)
_NO_DECLINE = Exemption(
    reason="No decline of near-expired reads before vLLM PR #47021 (0.26.0): D exports no "
    "deadline and P reads however late, so neither policy's outcome of a decline shows.",
    evidence="vllm-cpu 0.21.0 source (no remote_blocks_expiry_time, no 'Declining expired "
    "remote read'); the 0.21.0 run: docs/compat/.",
    defect=NO_DECLINE,
)
_STREAM = Exemption(
    reason="No kv_transfer_params on a streamed D answer (vLLM PR #40186, in 0.33.0, puts "
    "them on the terminal chunk): a router that streams D's leg caches nothing.",
    evidence="vllm-cpu 0.32.0, 2026-11-30 (docs/vllm-cpu.md §8): no chunk of D's stream "
    "carried the key; the non-streaming answer did.",
    params=(("stream", "True"),),
    defect=STREAM_PARAMS,
)
# The operational scenarios (suites/conformance/test_operations.py). On the emulator
# only its vLLM-reproducing parametrization ("ops" = "vllm") is pinned: it must show
# what real vLLM shows (docs/engine.md "Operations").
_AS_VLLM = (("ops", "vllm"),)
_PINNED_RETENTION = RETENTION_PINS.what
_SAME_ID_PEER = SAME_ID_PEER.what[0].lower() + SAME_ID_PEER.what[1:]


def _as_vllm(what: str, defect: Defect) -> Exemption:
    return Exemption(
        reason=f"Emulator with --peer-cache vllm --retained-blocks pin "
        f"--max-waiting-seconds 0 reproduces vLLM 0.32: {what}.",
        evidence="emulator 0.32 shape, 2026-12-01: fails as vllm-cpu does "
        "(the same assertion; the default flags pass).",
        params=_AS_VLLM,
        defect=defect,
    )


EXEMPTIONS: dict[tuple[str, str], list[Exemption]] = {
    ("test_retained_blocks_do_not_starve_new_requests", "emulator"): [
        _as_vllm(_PINNED_RETENTION, RETENTION_PINS)
    ],
    ("test_queued_request_has_a_bound_and_a_clear_error", "emulator"): [
        _as_vllm(_PINNED_RETENTION, RETENTION_PINS)
    ],
    ("test_d_restarted_next_turn_misses_and_reuse_resumes", "emulator"): [
        _as_vllm(_SAME_ID_PEER, SAME_ID_PEER)
    ],
    ("test_p_restarted_new_and_existing_conversations_served", "emulator"): [
        _as_vllm(_SAME_ID_PEER, SAME_ID_PEER)
    ],
    ("test_retained_blocks_do_not_starve_new_requests", "vllm-cpu"): [
        Exemption(
            reason=f"Confirmed: {_PINNED_RETENTION}.",
            evidence="vllm-cpu 0.32.0, 2026-12-01, D with 12 blocks (11 usable), TTL 24 s: three "
            "retained 363-token turns (KV usage 0.82); the next request got no answer in 10 s, "
            "D's stats 'Running: 0 reqs, Waiting: 1 reqs, KV fetch: 1 waiting to start' until "
            "'Releasing expired KV blocks ... retrieved by 0 remote worker(s)' at the TTL.",
            defect=RETENTION_PINS,
        )
    ],
    ("test_queued_request_has_a_bound_and_a_clear_error", "vllm-cpu"): [
        Exemption(
            reason=f"Confirmed: {_PINNED_RETENTION}; vLLM has no queue timeout, so the wait "
            "lasts until the TTL (480 s by default) or the client gives up.",
            evidence="vllm-cpu 0.32.0, 2026-12-01: the same fill; no answer and no error in 10 s "
            "(gauges over 9 samples: running 0, waiting 1; KV usage 0.82).",
            defect=RETENTION_PINS,
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
            defect=SAME_ID_PEER,
        )
    ],
    ("test_p_restarted_new_and_existing_conversations_served", "vllm-cpu"): [
        Exemption(
            reason=f"Confirmed: {_SAME_ID_PEER}. D's policy recompute hides it from the client "
            "(answers stay correct) but D never pulls from the new P again.",
            evidence="vllm-cpu 0.32.0, 2026-12-01: after P restarted, every D read of P's dicts "
            "failed with 'transfer_setup_failed' (NIXL_ERR_REMOTE_DISCONNECT) and was recomputed "
            "on D; no bytes moved.",
            defect=SAME_ID_PEER,
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
            defect=FEATURE_OFF,
        )
    ],
    ("test_ttl_expiry_d_releases_and_p_declines", "vllm-cpu"): [_NO_DECLINE],
    ("test_failed_read_outcome_follows_the_policy", "vllm-cpu"): [
        replace(_NO_DECLINE, params=(("failure", "declined"),)),
        Exemption(
            reason="The failed handshake kills P's engine (vllm-cpu 0.21.0; 0.22.0 skips the "
            "post-processing of failed requests): the client gets a 500 from a dead engine "
            "and P serves nothing after.",
            evidence="vllm-cpu 0.21.0, 2026-12-04 08:28: 'NIXL transfer failure: "
            "handshake_failed', then KeyError 'gone-…' in get_finished, 'EngineCore "
            "encountered a fatal error', EngineDeadError; every later request to that P was "
            "refused (docs/compat/runs/0.21.0).",
            params=(("failure", "unreachable"),),
            defect=HANDSHAKE_KILLS_ENGINE,
        ),
        *(
            Exemption(
                reason="Suspected upstream defect 1 for a read that fails because D is gone: "
                "under kv_load_failure_policy=recompute P's request stays waiting (deferred, "
                "KV fetch in progress) instead of recomputing.",
                evidence="vllm-cpu 0.31.0 dense and 0.32.0 dense, hybrid and MoE, 2026-12-04 "
                "(docs/compat/runs/0.31.0, 0.32.0): no answer within 45 s, queue gauges "
                "running 0, waiting 1, deferred 1; vllm-cpu 0.29.0 recomputed (runs/0.29.0).",
                params=(("failure", "unreachable"), ("policy_p", f"recompute-{scheduler}")),
                defect=DECLINE_RECOMPUTE,
            )
            for scheduler in ("sync", "async")
        ),
        *(
            Exemption(
                reason="Suspected upstream defect 1, as in test_decline_outcome_per_failure_"
                "policy[recompute]: after P declines a near-expired read under "
                "kv_load_failure_policy=recompute the request stalls instead of recomputing.",
                evidence="vllm-cpu 0.32.0 (test_ttl.py's decline under recompute, 2026-11-30 "
                "and 2026-12-04); vllm-cpu 0.29.0 recomputes ('Recovered from KV load "
                "failure: 1 request(s) rescheduled', 2026-12-04).",
                params=(("failure", "declined"), ("policy_p", f"recompute-{scheduler}")),
                defect=DECLINE_RECOMPUTE,
            )
            for scheduler in ("sync", "async")
        ),
    ],
    ("test_decline_outcome_per_failure_policy", "vllm-cpu"): [
        _NO_DECLINE,
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
            defect=DECLINE_RECOMPUTE,
        ),
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
            defect=SUFFIX_TRIM,
        )
    ],
    ("test_non_continuation_matches_recompute", "vllm-cpu"): [_NON_CONTINUATION],
    # vLLM's serving layer, not its connector: ours cannot put params on a stream either
    ("test_d_node_params", "vllm-cpu"): [_STREAM],
    ("test_d_node_params", "vllm-cpu+bidir-kv"): [_STREAM],
    # the emulator in its 0.32 shape (--emulate-vllm 0.32) streams no params, as vLLM
    ("test_d_node_params", "emulator"): [_STREAM],
    ("test_hybrid_rewritten_history_reads_only_where_every_group_allows", "vllm-cpu"): [
        Exemption(
            reason="vLLM reads D's whole history for a rewritten prompt on a hybrid model "
            "too: nothing compares the prompt with D's tokens (vLLM issue #43094), and the "
            "sliding-window group's blocks are paired by suffix whatever the cut.",
            evidence="vllm-cpu 0.32.0, 2026-12-04, the hybrid tiny model (window 256, block "
            "128): D held 899 tokens; P, holding 640 itself, read 259 tokens for a history "
            "rewritten inside D's last block (256 verified) and 199 for one rewritten a block "
            "earlier (none readable: D had freed the block the window needs there).",
            params=(("cut", cut),),
            defect=NON_CONTINUATION,
            families=("hybrid",),
        )
        for cut in ("late", "early")
    ],
    ("test_another_conversations_params_read_nothing_unverified", "vllm-cpu"): [
        Exemption(
            reason="vLLM reads whatever blocks a D dict names: P compares neither token ids "
            "nor block hashes, so another conversation's params, live or already read, import "
            "that conversation's KV under this prompt (vLLM issue #43094); upstream only the "
            "example proxy's continuation guard (vLLM PR #44838, open) stands in between. Our "
            "connector's P verifies D's chain (vllm-cpu+bidir-kv passes).",
            evidence="vllm-cpu 0.32.0, 2026-12-04: P handed conversation A's live D dict (474 "
            "tokens offered) with conversation B's 474-token prompt read 346 tokens (786432 "
            "bytes, one transfer) of A's KV on top of its own 128-token hit.",
            defect=FOREIGN_PARAMS,
        )
    ],
}


def _param_id(value: Any) -> str:
    """A parameter as its test id shows it: ``("recompute", "sync")`` -> recompute-sync."""
    return "-".join(map(str, value)) if isinstance(value, tuple) else str(value)


def exemption_for(
    scenario: str,
    backend: str,
    params: dict[str, Any],
    release: str | None = None,
    family: str | None = None,
) -> Exemption | None:
    """The pin that applies to one parametrization of ``scenario`` on ``backend`` at
    ``release`` with a ``family`` model, if any."""
    for ex in EXEMPTIONS.get((scenario, backend), []):
        if ex.matches(params, release, family):
            return ex
    return None
