"""Operational events on the emulated engine (issue 16): memory pressure, bounded
queues, a stalled scheduler, peers restarted with the same engine id.

Real ``bidir-kv engine`` processes on loopback. D's KV capacity is made small
(``--kv-capacity-tokens``) so a few retained turns fill it.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

from bidir_kv.client import Completion, fetch
from bidir_kv.testing.engines import EnginePair, random_prompt
from bidir_kv.testing.faults import restart_node
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.testing.poll import wait_for

Factory = Callable[..., EnginePair]
EVICTED = "vllm:nixl_num_kv_evicted_reqs_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
# 64 blocks of 16 tokens (63 usable): four retained 200-token turns (13 blocks each)
# leave 11 free, fewer than the next turn's 13
SMALL_KV = 1024
PROMPT, GEN = 200, 8


def _small_d(*extra: str) -> dict[str, Any]:
    return {"kv_capacity_tokens": SMALL_KV, "extra_args": extra}


def _fill_with_retained(pair: EnginePair, seed: str, turns: int = 4) -> None:
    rng = random.Random(seed)
    for _ in range(turns):
        _, d = pair.turn(random_prompt(rng, PROMPT), GEN)
        assert d is not None, "P leg failed"
        d.raise_for_status()
        assert d.params is not None  # D retains the turn for P's next read
    assert pair.state("d")["retained"] == turns


def _next_turn(pair: EnginePair, seed: str, timeout: float) -> Completion:
    prompt = random_prompt(random.Random(seed), PROMPT)
    pr = pair.prefill(prompt, None).raise_for_status()
    return pair.d.complete(prompt, GEN, pr.params, timeout=timeout)


# ---- memory pressure --------------------------------------------------------------


def test_retained_turns_are_evicted_before_new_work_waits(engine_pair: Factory) -> None:
    """D full of retained turns: the next request evicts the oldest and is served at
    once, counted in vllm:nixl_num_kv_evicted_reqs (vLLM would wait for the TTL)."""
    pair = engine_pair(decode=_small_d("--max-waiting-seconds", "5"))
    _fill_with_retained(pair, "evict")
    before = pair.d.metrics([EVICTED])
    d = _next_turn(pair, "evict-next", timeout=20)
    d.raise_for_status()
    assert d.elapsed < 5, f"the request waited {d.elapsed:.1f} s"
    assert (pair.d.metrics([EVICTED]) - before).value(EVICTED) >= 1
    state = pair.state("d")
    assert state["retained"] <= 4  # the oldest gave way, the new turn is retained


def test_evicted_turn_read_by_p_is_a_miss_not_an_error(engine_pair: Factory) -> None:
    """P reading the evicted (oldest) turn later recomputes (policy recompute)."""
    pair = engine_pair(decode=_small_d(), kv={"kv_load_failure_policy": "recompute"})
    rng = random.Random("evicted-read")
    first = random_prompt(rng, PROMPT)
    _, d1 = pair.turn(first, GEN)
    assert d1 is not None and d1.ok and d1.params is not None
    for _ in range(4):
        _, d = pair.turn(random_prompt(rng, PROMPT), GEN)
        assert d is not None and d.ok
    assert pair.state("d")["retained"] == 4  # the first turn was evicted
    pr = pair.p.complete([*first, *d1.token_ids, 300], 1, d1.params.for_prefill_hit())
    pr.raise_for_status()


def test_pinned_retention_reproduces_vllm_and_the_wait_is_bounded(
    engine_pair: Factory,
) -> None:
    """``--retained-blocks pin`` (vLLM): the next request cannot be admitted; it fails
    with 503 naming the KV blocks after --max-waiting-seconds instead of hanging."""
    pair = engine_pair(decode=_small_d("--retained-blocks", "pin", "--max-waiting-seconds", "2"))
    _fill_with_retained(pair, "pin")
    d = _next_turn(pair, "pin-next", timeout=20)
    assert d.status == 503, (d.status, d.error)
    assert "KV blocks" in (d.error or "") and "--max-waiting-seconds" in (d.error or "")
    assert d.elapsed < 15
    state = pair.state("d")
    assert state["waiting"] == 0 and state["retained"] == 4


def test_bounded_wait_answers_a_stream_with_503_before_any_byte(engine_pair: Factory) -> None:
    pair = engine_pair(decode=_small_d("--retained-blocks", "pin", "--max-waiting-seconds", "1"))
    _fill_with_retained(pair, "pin-stream")
    prompt = random_prompt(random.Random("pin-stream-next"), PROMPT)
    pr = pair.prefill(prompt, None).raise_for_status()
    d = pair.d.complete(prompt, GEN, pr.params, stream=True, timeout=20)
    assert d.status == 503 and "waited" in (d.error or ""), (d.status, d.error)


# ---- a stalled scheduler ------------------------------------------------------------


def test_health_sees_a_stalled_step_loop(engine_pair: Factory) -> None:
    """Fault ``stall`` with a request running: /health turns 503 naming the stall,
    and 200 again once the loop runs; an idle stalled engine stays healthy."""
    pair = engine_pair(decode={"extra_args": ("--health-stall-seconds", "1")})
    pair.set_faults("d", stall=True)
    assert fetch(pair.d.url + "/health").status == 200  # nothing pending: nothing to see
    done: list[Completion] = []
    prompt = random_prompt(random.Random("stall"), 50)
    worker = threading.Thread(target=lambda: done.append(pair.d.complete(prompt, 4, timeout=60)))
    worker.start()
    try:
        reply = wait_for(
            lambda: (r := fetch(pair.d.url + "/health")).status == 503 and r,
            timeout=20,
            what="health 503",
        )
        assert "scheduler stalled" in reply.text and "running" in reply.text
    finally:
        pair.set_faults("d", stall=False)
        worker.join(60)
    assert done and done[0].ok
    wait_for(
        lambda: fetch(pair.d.url + "/health").status == 200, timeout=10, what="health back to 200"
    )


# ---- peers restarted with the same engine id ----------------------------------------


def _restart(pair: EnginePair, which: str) -> None:
    """Stop P or D and start a new process as a deploy would: same engine id, same
    HTTP and side-channel ports, new data port and blocks (checked: the old process is
    gone and a new one serves)."""
    topo = pair.topo
    node = topo.prefill[0] if which == "p" else topo.decode[0]
    restart_node(topo, node)
    client = EngineClient(node)
    if which == "p":
        pair.p = client
    else:
        pair.d = client


def _hits(client: EngineClient) -> float:
    return client.metrics([EXTERNAL_HITS]).value(EXTERNAL_HITS)


def test_p_restarted_with_the_same_engine_id_serves_every_later_request(
    engine_pair: Factory,
) -> None:
    """D cached P; P restarts (same id and address, new data port): D sees the newer
    remote_registration_generation, handshakes again and pulls for every new turn."""
    pair = engine_pair()
    rng = random.Random("p-restart")
    _, d = pair.turn(random_prompt(rng, PROMPT), GEN)
    assert d is not None and d.ok and d.params is not None
    old_gen = pair.prefill(random_prompt(rng, 40), None).params
    assert old_gen is not None
    _restart(pair, "p")
    for _ in range(3):
        prompt = random_prompt(rng, PROMPT)
        h0 = _hits(pair.d)
        pr, d = pair.turn(prompt, GEN)
        pr.raise_for_status()
        assert pr.params is not None
        assert pr.params.remote_registration_generation > old_gen.remote_registration_generation
        assert d is not None, "no D leg"
        d.raise_for_status()
        assert _hits(pair.d) - h0 == PROMPT  # the whole prompt was pulled from the new P


def test_peer_cache_vllm_keeps_the_stale_peer(engine_pair: Factory) -> None:
    """``--peer-cache vllm`` reproduces vLLM 0.32 (peers cached by engine id): after
    the restart D keeps reading the dead process, so new turns fail."""
    pair = engine_pair(decode={"extra_args": ("--peer-cache", "vllm")})
    rng = random.Random("p-restart-vllm")
    _, d = pair.turn(random_prompt(rng, PROMPT), GEN)
    assert d is not None and d.ok
    _restart(pair, "p")
    _, d = pair.turn(random_prompt(rng, PROMPT), GEN)
    assert d is not None and d.status == 500


def test_d_restarted_reads_of_old_params_miss_and_reuse_returns(engine_pair: Factory) -> None:
    """P cached D; D restarts. A turn with the old D's params is a miss (recompute,
    no hit counted); the next turn carries the new D's generation and pulls again."""
    pair = engine_pair(
        prefill={"enable_prefix_caching": False},
        prefill_kv={"kv_load_failure_policy": "recompute"},
    )
    rng = random.Random("d-restart")
    prompt = random_prompt(rng, PROMPT)
    _, d = pair.turn(prompt, GEN)
    assert d is not None and d.ok and d.params is not None
    for step in range(3):
        if step == 1:
            _restart(pair, "d")
        prompt = [*prompt, *d.token_ids, *random_prompt(rng, 30)]
        h0 = _hits(pair.p)
        pr, nd = pair.turn(prompt, GEN, previous=d.params)
        pr.raise_for_status()
        pulled = _hits(pair.p) - h0
        if step == 1:
            assert pulled == 0  # the old D's blocks are gone: a miss, not a hit
        else:
            assert pulled > 0, f"turn {step + 2}: P did not pull D's history"
        assert nd is not None and nd.ok and nd.params is not None
        d = nd
