"""What retention costs D's running batch on the emulated engine (issue 33): retained
turns take blocks a decode needs, a decode that cannot grow is preempted and recomputed
(vLLM V1), and the retention budget keeps that room free (docs/engine.md "Memory").

Real ``bidir-kv engine`` processes on loopback; every request is sent after the one
before it has finished, so the counts do not depend on timing. D holds 1024 tokens
(64 usable blocks of 16): three retained 200-token turns take 39 of them, and a
100-token prompt answered with 320 tokens needs 27 by its end, two more than are left.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from bidir_kv.testing.engines import EnginePair, random_prompt
from bidir_kv.testing.poll import wait_for

Factory = Callable[..., EnginePair]
PREEMPTIONS = "vllm:num_preemptions_total"
RETAINED = "bidir_kv:kv_cache_retained_perc"
USAGE = "vllm:kv_cache_usage_perc"
SMALL_KV = 1024
WARM, WARM_GEN, LONG, LONG_GEN = 200, 8, 100, 320
USABLE = SMALL_KV // 16


def _run(pair: EnginePair) -> tuple[list[int], float, float]:
    """Three short turns, then one long answer; returns the long answer's token ids, the
    preemptions it caused on D, and D's retained share just before it."""
    rng = random.Random("memory")
    for _ in range(3):
        _, d = pair.turn(random_prompt(rng, WARM), WARM_GEN)
        assert d is not None
        d.raise_for_status()
    before = pair.d.metrics([PREEMPTIONS, RETAINED])
    _, d = pair.turn(random_prompt(rng, LONG), LONG_GEN)
    assert d is not None
    d.raise_for_status()
    after = pair.d.metrics([PREEMPTIONS])
    assert len(d.token_ids) == LONG_GEN
    return d.token_ids, (after - before).value(PREEMPTIONS), before.value(RETAINED)


@pytest.mark.parametrize("pinned", [False, True], ids=["evict", "pin"])
def test_retained_turns_preempt_a_decode_and_the_budget_prevents_it(
    engine_pair: Factory, pinned: bool
) -> None:
    """OFF: no preemption. ON: the long answer is preempted once, then finishes with the
    same tokens (evict: its recompute releases retained turns; pin, vLLM's: it waits for
    them, here a short TTL). ON with a retention budget of 0.3: retained turns beyond
    19 blocks go as soon as a newer one is retained, and nothing is preempted."""
    decode: dict[str, Any] = {"kv_capacity_tokens": SMALL_KV}
    if pinned:
        decode["extra_args"] = ("--retained-blocks", "pin", "--max-waiting-seconds", "0")
    ttl = {"decoder_kv_blocks_ttl": 10} if pinned else {}
    off_ids, off, off_share = _run(
        engine_pair(decode=decode, kv={"bidirectional_kv_xfer": False, **ttl})
    )
    on_ids, on, on_share = _run(engine_pair(decode=decode, kv=ttl))
    assert off == 0 and off_share == 0.0
    assert on >= 1, "retained turns should have left too little room for the long answer"
    assert on_share == pytest.approx(39 / USABLE)
    assert on_ids == off_ids  # the recompute is exact
    if pinned:
        return  # vLLM's mode releases nothing early: no budget
    budget_ids, budgeted, share = _run(
        engine_pair(decode=decode, decode_kv={"bidir_kv_retention_budget": 0.3})
    )
    assert budgeted == 0
    assert share <= 0.3
    assert budget_ids == off_ids


def test_usage_and_retained_share_are_current_on_an_idle_engine(engine_pair: Factory) -> None:
    """The gauges are read at the scrape: after the turns end (no step runs any more),
    D's usage is exactly what its retained turns hold."""
    pair = engine_pair(decode={"kv_capacity_tokens": SMALL_KV})
    rng = random.Random("gauges")
    for _ in range(2):
        _, d = pair.turn(random_prompt(rng, WARM), WARM_GEN)
        assert d is not None
        d.raise_for_status()
    snap = pair.d.metrics([USAGE, RETAINED])
    assert snap.value(RETAINED) == pytest.approx(26 / USABLE)
    assert snap.value(USAGE) == pytest.approx(26 / USABLE)
    assert pair.p.metrics([RETAINED]).value(RETAINED) == 0.0  # P leases, it retains nothing


def test_an_idle_engine_reports_the_memory_its_ttl_released(engine_pair: Factory) -> None:
    """D's turns expire at a 1 s TTL while D runs no step: usage and the retained share
    fall to 0 (a gauge written only at a step's end would keep the old value)."""
    pair = engine_pair(decode={"kv_capacity_tokens": SMALL_KV}, kv={"decoder_kv_blocks_ttl": 1})
    _, d = pair.turn(random_prompt(random.Random("ttl"), WARM), WARM_GEN)
    assert d is not None
    d.raise_for_status()
    assert pair.d.metrics([RETAINED]).value(RETAINED) > 0

    def drained() -> bool:
        snap = pair.d.metrics([USAGE, RETAINED])
        return snap.value(RETAINED) == 0.0 and snap.value(USAGE) == 0.0

    wait_for(drained, 15, "D's gauges to show the expired turn released")


def test_d_records_its_decode_as_vllm_does(engine_pair: Factory) -> None:
    """vLLM's decode histograms on D: one inter-token gap per token after the first, one
    TPOT per finished request (P's one-token legs record neither)."""
    pair = engine_pair()
    names = [
        "vllm:inter_token_latency_seconds_count",
        "vllm:request_time_per_output_token_seconds_count",
    ]
    before_p, before_d = pair.p.metrics(names), pair.d.metrics(names)
    _, d = pair.turn(random_prompt(random.Random("itl"), 64), 20)
    assert d is not None
    d.raise_for_status()
    got_d = pair.d.metrics(names) - before_d
    assert got_d.value(names[0]) == 19 and got_d.value(names[1]) == 1
    got_p = pair.p.metrics(names) - before_p
    assert got_p.value(names[0]) == 0 and got_p.value(names[1]) == 0
