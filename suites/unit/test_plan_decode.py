"""``plan``'s decode-side terms (issue 33): retained turns beside D's running batch, the
retention budget that keeps them apart, the TTL advice bounded by it, a pull's share of
D's memory time."""

from __future__ import annotations

import pytest

from bidir_kv.bench.distributions import Distribution
from bidir_kv.plan.cli import build_parser, render_text, run_plan
from bidir_kv.plan.decode import (
    DecodeSide,
    mean_decode_context,
    pull_hbm_ms,
    retention_room,
    running_gib,
)
from bidir_kv.plan.planner import CostModel, PlanError, TtlRow, Workload

GIB = 2**30
COST = CostModel(
    recompute_us_per_token=10.0,
    recompute_us_per_token_ctx=0.0,
    xfer_us_per_token=1.0,
    pull_overhead_us=0.0,
    kv_bytes_per_token=GIB / 1000,  # 1000 tokens per GiB
    source="explicit",
)
WORK = Workload(
    conversations_per_s=0.1,
    turns=3,
    first_prompt_tokens=1000,
    tokens_per_turn=500,
    output_tokens=200,
    gap=Distribution("const", (10.0,)),
)


def test_running_batch_and_the_room_left_for_retention() -> None:
    # prompts 1000, 1500, 2000 (mean 1500) + half of a 200-token answer
    assert mean_decode_context(WORK) == 1600
    side = DecodeSide(kv_gib=10.0, concurrency=4)
    assert running_gib(COST, WORK, side) == pytest.approx(6.4)
    rows = [TtlRow(30, 0.0, 0, 3.0, 0.4), TtlRow(480, 0.0, 0, 4.0, 0.5)]
    room = retention_room(COST, WORK, side, rows)
    assert room.room_gib == pytest.approx(3.6) and room.budget_share == 0.36
    assert room.overflows == {30: False, 480: True}
    assert "bidir_kv_retention_budget to 0.36" in room.recommend(rows[1])
    assert "no preemption expected" in room.recommend(rows[0])
    full = retention_room(COST, WORK, DecodeSide(kv_gib=5.0, concurrency=4), rows)
    assert full.room_gib == 0 and "fills D's" in full.recommend(rows[0])
    with pytest.raises(PlanError):
        DecodeSide(kv_gib=0, concurrency=1)


def test_a_pull_reads_each_retained_byte_once_per_rank() -> None:
    side = DecodeSide(kv_gib=10.0, concurrency=1, ranks=8, hbm_gbytes_per_s=4800.0)
    # 24k tokens x 262144 B / 8 ranks = 786 MB per rank at 4.8 TB/s
    qwen = CostModel(
        recompute_us_per_token=14.7,
        recompute_us_per_token_ctx=0.0,
        xfer_us_per_token=11.1,
        pull_overhead_us=0.0,
        kv_bytes_per_token=262144,
        source="explicit",
    )
    assert pull_hbm_ms(qwen, 24000, side) == pytest.approx(786.432e6 / 4.8e12 * 1e3)


def _plan(*extra: str) -> dict:
    args = build_parser().parse_args(
        ["--profile", "qwen3-32b-p5en", "--conversation-rate", "0.05", *extra]
    )
    return run_plan(args)


def test_the_ttl_advice_leaves_the_running_batch_its_room() -> None:
    free = _plan()
    assert free["decode_side"] is None
    assert "Decode side: not planned" in render_text(free)
    tight = _plan("--d-kv-gib", "45", "--decode-concurrency", "8")
    d = tight["decode_side"]
    assert d["room_gib"] == pytest.approx(45 - d["running_gib"])
    fitting = [r for r in tight["ttl"] if r["held_gib"] <= d["room_gib"]]
    assert tight["recommended_ttl_s"] == max(r["ttl_s"] for r in fitting)
    assert tight["recommended_ttl_s"] < free["recommended_ttl_s"]
    text = render_text(tight)
    assert "Decode side: D's pool 45.0 GiB, 8 requests decoding" in text
    assert "overflows: preemptions (TPOT) or waits (TTFT)" in text
    assert "decode step" in text and "Decode side:" in tight["ttl_reason"]
