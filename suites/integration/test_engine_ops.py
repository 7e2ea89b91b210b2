"""Operational events on the emulated engine (issue 16): memory pressure, bounded
queues, a stalled scheduler, peers restarted with the same engine id.

Real ``bidir-kv engine`` processes on loopback. D's KV capacity is made small
(``--kv-capacity-tokens``) so a few retained turns fill it.
"""

from __future__ import annotations

import random
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from bidir_kv.testing.engines import EnginePair, random_prompt
from bidir_kv.testing.pd_client import Completion
from bidir_kv.testing.poll import wait_for

Factory = Callable[..., EnginePair]
EVICTED = "vllm:nixl_num_kv_evicted_reqs_total"
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
        d.require_ok()
        assert d.params is not None  # D retains the turn for P's next read
    assert pair.state("d")["retained"] == turns


def _next_turn(pair: EnginePair, seed: str, timeout: float) -> Completion:
    prompt = random_prompt(random.Random(seed), PROMPT)
    pr = pair.prefill(prompt, None).require_ok()
    return pair.d.complete(prompt, GEN, pr.params, timeout=timeout)


def _health(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


# ---- memory pressure --------------------------------------------------------------


def test_retained_turns_are_evicted_before_new_work_waits(engine_pair: Factory) -> None:
    """D full of retained turns: the next request evicts the oldest and is served at
    once, counted in vllm:nixl_num_kv_evicted_reqs (vLLM would wait for the TTL)."""
    pair = engine_pair(decode=_small_d("--max-waiting-seconds", "5"))
    _fill_with_retained(pair, "evict")
    before = pair.d.metrics([EVICTED])
    d = _next_turn(pair, "evict-next", timeout=20)
    d.require_ok()
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
    pr.require_ok()


def test_pinned_retention_reproduces_vllm_and_the_wait_is_bounded(
    engine_pair: Factory,
) -> None:
    """``--retained-blocks pin`` (vLLM): the next request cannot be admitted; it fails
    with 503 naming the KV blocks after --max-waiting-seconds instead of hanging."""
    pair = engine_pair(
        decode=_small_d("--retained-blocks", "pin", "--max-waiting-seconds", "2")
    )
    _fill_with_retained(pair, "pin")
    d = _next_turn(pair, "pin-next", timeout=20)
    assert d.status == 503, (d.status, d.error)
    assert "KV blocks" in (d.error or "") and "--max-waiting-seconds" in (d.error or "")
    assert d.elapsed < 15
    state = pair.state("d")
    assert state["waiting"] == 0 and state["retained"] == 4


def test_bounded_wait_answers_a_stream_with_503_before_any_byte(engine_pair: Factory) -> None:
    pair = engine_pair(
        decode=_small_d("--retained-blocks", "pin", "--max-waiting-seconds", "1")
    )
    _fill_with_retained(pair, "pin-stream")
    prompt = random_prompt(random.Random("pin-stream-next"), PROMPT)
    pr = pair.prefill(prompt, None).require_ok()
    d = pair.d.complete(prompt, GEN, pr.params, stream=True, timeout=20)
    assert d.status == 503 and "waited" in (d.error or ""), (d.status, d.error)


# ---- a stalled scheduler ------------------------------------------------------------


def test_health_sees_a_stalled_step_loop(engine_pair: Factory) -> None:
    """Fault ``stall`` with a request running: /health turns 503 naming the stall,
    and 200 again once the loop runs; an idle stalled engine stays healthy."""
    pair = engine_pair(decode={"extra_args": ("--health-stall-seconds", "1")})
    pair.set_faults("d", stall=True)
    assert _health(pair.d.url)[0] == 200  # nothing pending: nothing to see
    done: list[Completion] = []
    prompt = random_prompt(random.Random("stall"), 50)
    worker = threading.Thread(target=lambda: done.append(pair.d.complete(prompt, 4, timeout=60)))
    worker.start()
    try:
        _, text = wait_for(
            lambda: (s := _health(pair.d.url))[0] == 503 and s, timeout=20, what="health 503"
        )
        assert "scheduler stalled" in text and "running" in text
    finally:
        pair.set_faults("d", stall=False)
        worker.join(60)
    assert done and done[0].ok
    wait_for(lambda: _health(pair.d.url)[0] == 200, timeout=10, what="health back to 200")
