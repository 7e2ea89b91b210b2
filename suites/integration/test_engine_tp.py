"""``--tensor-parallel-size N``: N emulated ranks, KV and descriptors per rank (docs/engine.md).

Real engine pairs on loopback: the same two-turn conversation runs through a TP 1 and
a TP 2 pair; both pull directions report per-rank READs (N observations, each with
1/N of the bytes) whose descriptor total is N x TP 1's, the same total bytes, KV
that verifies, and the same answer. Unequal TP on P and D is refused at the
handshake, naming both sizes.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from bidir_kv.scrape import MetricsSnapshot
from bidir_kv.testing.engines import EnginePair, random_prompt, transport_names
from bidir_kv.testing.poll import wait_for

DESCS = "vllm:nixl_num_descriptors_sum"
DESC_OBS = "vllm:nixl_num_descriptors_count"
BYTES = "vllm:nixl_bytes_transferred_sum"
XFERS = "vllm:nixl_xfer_time_seconds_count"
FAILED = "vllm:nixl_num_failed_transfers_total"
MISMATCH = "bidir_kv:kv_verify_mismatched_blocks_total"
TP = "bidir_kv:tensor_parallel_size"


def _tp(n: int) -> dict[str, Any]:
    return {"extra_args": ("--tensor-parallel-size", str(n))} if n > 1 else {}


def _conversation(pair: EnginePair) -> dict[str, Any]:
    """Turn 1 (D pulls P's prefill), turn 2 (P pulls D's history): what each read reported."""
    prompt = random_prompt(random.Random("tp-conversation"), 200)
    p0, d0 = pair.snap()
    pr, dr = pair.turn(prompt, 100)  # D's history outgrows P's cache by >= the threshold
    assert pr.ok and pr.params is not None and dr is not None and dr.ok and dr.params is not None
    d1 = pair.d.metrics()
    follow = prompt + dr.token_ids + random_prompt(random.Random("tp-turn2"), 40)
    pr2, dr2 = pair.turn(follow, 8, dr.params)
    assert pr2.ok and dr2 is not None and dr2.ok
    p2 = pair.p.metrics()
    wait_for(lambda: pair.state("p")["leased"] == 0)

    def reads(delta: MetricsSnapshot) -> dict[str, float]:
        return {k: delta.value(k) for k in (DESCS, DESC_OBS, BYTES, XFERS, MISMATCH)}

    return {
        "d_pull": reads(d1 - d0),
        "p_pull": reads(p2 - p0),
        "answers": (dr.token_ids, dr2.token_ids),
        "tp_sizes": (pr.params.tp_size, dr.params.tp_size),
    }


@pytest.mark.parametrize("transport", transport_names())
def test_tp2_reads_per_rank_same_bytes_and_answer(
    engine_pair: Callable[..., EnginePair], transport: str
) -> None:
    one = _conversation(engine_pair(transport=transport))
    pair2 = engine_pair(transport=transport, prefill=_tp(2), decode=_tp(2))
    two = _conversation(pair2)
    assert two["tp_sizes"] == (2, 2) and one["tp_sizes"] == (1, 1)  # as vLLM: the owner's TP
    assert two["answers"] == one["answers"]
    for leg in ("d_pull", "p_pull"):
        a, b = one[leg], two[leg]
        assert a[XFERS] == 1 and a[BYTES] > 0, (leg, a)
        assert b[DESCS] == 2 * a[DESCS], (leg, a, b)  # each rank: TP 1's descriptor count
        assert b[DESC_OBS] == 2 and b[XFERS] == 2, (leg, b)  # one observation per rank
        assert b[BYTES] == a[BYTES], (leg, a, b)  # each rank moved half
        assert a[MISMATCH] == 0 and b[MISMATCH] == 0, (leg, a, b)
    assert pair2.p.metrics().value(TP) == 2 and pair2.d.metrics().value(TP) == 2


def test_unequal_tp_is_refused_at_the_handshake_naming_both(
    engine_pair: Callable[..., EnginePair],
) -> None:
    pair = engine_pair(prefill=_tp(2), kv={"kv_load_failure_policy": "recompute"})
    prompt = random_prompt(random.Random("tp-unequal"), 100)
    d0 = pair.d.metrics()
    mark = pair.d.log_mark()
    pr, dr = pair.turn(prompt, 4)
    assert pr.ok and dr is not None and dr.ok  # recomputed after the refused pull
    delta = pair.d.metrics() - d0
    assert delta.value(FAILED) == 1 and delta.value(BYTES) == 0
    log = pair.d.log_since(mark) or ""
    assert "tensor_parallel_size 2, we run 1" in log, log
