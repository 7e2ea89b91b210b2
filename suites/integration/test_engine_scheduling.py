"""The emulated engine schedules as vLLM V1 does (docs/engine.md "Scheduling").

Real ``bidir-kv engine`` processes on loopback. Behaviour is read from step counts
(``vllm:iteration_tokens_total``: one observation per engine step) and from
``/_emulator/state``, never from absolute times. The ``stall`` fault holds the step
loop at a known point, so which requests share a step does not depend on the
machine's speed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from bidir_kv.client import Completion
from bidir_kv.testing.engines import EnginePair, random_prompt
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.testing.poll import wait_for

Factory = Callable[..., EnginePair]
STEPS = "vllm:iteration_tokens_total_count"
STEP_TOKENS = "vllm:iteration_tokens_total_sum"


def _steps(client: EngineClient) -> tuple[float, float]:
    snap = client.metrics([STEPS, STEP_TOKENS])
    return snap.value(STEPS), snap.value(STEP_TOKENS)


def _two_requests_behind_a_stall(
    pair: EnginePair, which: str, max_tokens: int, pool: ThreadPoolExecutor
) -> tuple[float, list[Completion]]:
    """Two plain requests sent while the step loop is stalled with the first admitted;
    returns the steps taken once the stall is cleared and both answers."""
    client = pair.p if which == "p" else pair.d
    rng = random.Random(f"queue-{which}")
    pair.set_faults(which, stall=True)
    first = pool.submit(client.complete, random_prompt(rng, 40), max_tokens)
    wait_for(lambda: pair.state(which)["running"] == 1, 20, "the first request admitted")
    second = pool.submit(client.complete, random_prompt(rng, 40), max_tokens)
    wait_for(lambda: pair.state(which)["waiting"] == 1, 20, "the second request queued")
    before, _ = _steps(client)
    pair.set_faults(which, stall=False)
    answers = [f.result(timeout=60) for f in (first, second)]
    for a in answers:
        a.raise_for_status()
    after, _ = _steps(client)
    return after - before, answers


def test_max_num_seqs_serves_concurrent_requests_one_after_the_other(
    engine_pair: Factory,
) -> None:
    """--max-num-seqs 1: two concurrent requests never share a step (2 × M steps for M
    tokens each); with the default (256) the second joins the first's batch (M + 1)."""
    pair = engine_pair(prefill={"extra_args": ("--max-num-seqs", "1")})
    m = 6
    with ThreadPoolExecutor(2) as pool:
        one_seq, answers = _two_requests_behind_a_stall(pair, "p", m, pool)
        assert all(len(a.token_ids or []) == m for a in answers)
        batched, _ = _two_requests_behind_a_stall(pair, "d", m, pool)
    assert one_seq == 2 * m, f"max_num_seqs 1 took {one_seq} steps"
    assert batched == m + 1, f"max_num_seqs 256 took {batched} steps"


def test_long_prefill_is_chunked_by_the_token_budget(engine_pair: Factory) -> None:
    """Chunked prefill: a 1000-token prompt with a 256-token budget takes ceil(1000/256)
    steps. With --no-enable-chunked-prefill a 10000-token prompt, longer than the
    profile's 8192-token budget, is one step (vLLM raises an unset budget to
    --max-model-len)."""
    budget = 256
    pair = engine_pair(
        prefill={"extra_args": ("--max-num-batched-tokens", str(budget))},
        decode={"extra_args": ("--no-enable-chunked-prefill",)},
    )
    rng = random.Random("chunked")
    for client, n, want in ((pair.p, 1000, math.ceil(1000 / budget)), (pair.d, 10000, 1)):
        steps0, tokens0 = _steps(client)
        client.complete(random_prompt(rng, n), 1).raise_for_status()
        steps1, tokens1 = _steps(client)
        assert steps1 - steps0 == want, f"{client}: {steps1 - steps0} steps, want {want}"
        assert tokens1 - tokens0 == n


def test_pull_completion_is_taken_at_the_next_step(engine_pair: Factory) -> None:
    """D decodes one request while it pulls another's prefill from P; the READ ends
    while a step is in flight (held by the stall fault) and the pulled request joins
    the batch only when that step is over."""
    pair = engine_pair()
    rng = random.Random("next-step")
    pair.set_faults("d", delay_transfers=1.0, delay_seconds=2.0, stall_seconds=0.1)
    with ThreadPoolExecutor(2) as pool:
        decoding: Future[Completion] = pool.submit(pair.d.complete, random_prompt(rng, 40), 200)
        wait_for(lambda: pair.state("d")["running"] == 1, 20, "D decoding")
        prompt = random_prompt(rng, 300)
        pr = pair.prefill(prompt, None).raise_for_status()
        pulled = pool.submit(pair.d.complete, prompt, 4, pr.params)
        wait_for(lambda: pair.state("d")["pulling"] == 1, 20, "D's READ started")
        pair.set_faults("d", stall=True)
        held = wait_for(
            lambda: (st := pair.state("d"))["received"] == 1 and st, 30, "D's READ over"
        )
        assert held["running"] == 1 and held["pulling"] == 1, held  # not yet in the batch
        assert pair.state("p")["leased"] == 0  # P got the READ's notification
        pair.set_faults("d", stall=False, stall_seconds=0.0)
        done = pulled.result(timeout=60).raise_for_status()
        decoding.result(timeout=60).raise_for_status()
    assert len(done.token_ids or []) == 4
    st = pair.state("d")
    assert st["received"] == 0 and st["pulling"] == 0
