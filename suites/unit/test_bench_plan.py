"""Planner math: KV bytes per token (GQA, MLA), FLOPs, break-even, TTFT rows, TTL memory."""

from __future__ import annotations

import json
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bidir_kv.bench.distributions import Distribution
from bidir_kv.engine.profiles import load_profile
from bidir_kv.paths import REPO_ROOT
from bidir_kv.plan.cli import main as plan_main
from bidir_kv.plan.derive import TARGETS, derive_profile, generated_profiles, target_shape
from bidir_kv.plan.modelcfg import ModelConfigError, load_model_config, model_shape
from bidir_kv.plan.planner import (
    CostModel,
    Hardware,
    PlanError,
    TtlRow,
    Workload,
    break_even_tokens,
    recommend_threshold,
    recommend_ttl,
    ttft_rows,
    ttl_rows,
)
from bidir_kv.policy import should_decline

CONFIGS = REPO_ROOT / "bidir_kv" / "data" / "model_configs"


def shape(name: str):
    return model_shape(load_model_config(CONFIGS / f"{name}.json"))


def test_qwen3_32b_gqa_kv_bytes_and_params() -> None:
    s = shape("qwen3-32b")
    assert s.attention == "gqa"
    # 64 layers × 8 KV heads × 128 × 2 (K, V) × 2 bytes
    assert s.kv_bytes_per_token(1) == 64 * 8 * 128 * 2 * 2 == 262_144
    # TP 8: one KV head per rank, the group total is unchanged
    assert s.kv_bytes_per_token_per_rank(8) == 32_768
    assert s.kv_bytes_per_token(8) == 262_144
    # TP 16 > 8 KV heads: heads are replicated, the group holds twice as much
    assert s.kv_bytes_per_token(16) == 2 * 262_144
    assert s.total_params == pytest.approx(32.8e9, rel=0.01)  # Qwen3-32B model card


def test_glm5_mla_kv_bytes_and_params() -> None:
    s = shape("glm-5-fp8")
    assert s.attention == "mla"
    latent = 78 * (512 + 64) * 2  # one latent per layer, bf16
    indexer = 78 * (128 + 4)  # FP8 indexer keys + fp32 scale
    assert s.kv_bytes_per_token_per_rank(8) == latent + indexer
    assert s.kv_bytes_per_token(8) == 8 * (latent + indexer)  # replicated on every rank
    assert s.total_params == pytest.approx(744e9, rel=0.01)  # GLM-5 model card: 744B
    assert s.active_params == pytest.approx(40e9, rel=0.03)  # 40B active


def test_mla_without_rope_dim_is_named() -> None:
    with pytest.raises(ModelConfigError, match="qk_rope_head_dim"):
        model_shape(
            {
                "num_hidden_layers": 2,
                "hidden_size": 8,
                "num_attention_heads": 2,
                "vocab_size": 10,
                "kv_lora_rank": 4,
                "intermediate_size": 16,
            }
        )
    with pytest.raises(ModelConfigError, match="num_hidden_layers"):
        model_shape({"hidden_size": 8})


def test_profiles_match_the_generation() -> None:
    """bidir_kv/data/profiles/*-p5en*.json are what bidir_kv.plan.derive generates:
    derived, calibrated on the published table, predicted (docs/profiles.md)."""
    generated = generated_profiles()
    assert set(generated) == {"qwen3-32b-p5en-derived", "qwen3-32b-p5en", "glm5-fp8-p5en"}
    for name, want in generated.items():
        on_disk = json.loads(
            (REPO_ROOT / "bidir_kv" / "data" / "profiles" / f"{name}.json").read_text()
        )
        assert set(on_disk) == set(want), name
        for key, value in want.items():
            if isinstance(value, float):
                assert on_disk[key] == pytest.approx(value, rel=1e-3), (name, key)
            else:
                assert on_disk[key] == value, (name, key)
        assert load_profile(name).sources


def test_derived_profile_matches_the_planner_derivation() -> None:
    """The first-principles profile: the emulator's terms are the planner's."""
    assert set(TARGETS) == {"qwen3-32b-p5en-derived"}
    for name, target in TARGETS.items():
        prof = load_profile(name)
        assert derive_profile(target)["sources"] == list(target.sources)
        assert prof.sources == tuple(target.sources) and prof.sources
        # the emulator's transfer model equals the planner's pull model (block-aligned pull;
        # the planner adds half an idle step for the completion seen at step granularity)
        cost = CostModel.from_hardware(target_shape(target.config), target.hardware)
        n = 640 * target.hardware.block_size
        wire_us = prof.transfer_seconds(n) * 1e6
        assert wire_us + prof.step_us / 2 == pytest.approx(cost.pull_us(n), rel=1e-6)
        assert prof.descriptors(n) == 640 * prof.descriptors_per_block
        assert prof.prefill_seconds(5_000, 1_000) * 1e6 == pytest.approx(
            cost.recompute_us(5_000, 1_000), rel=1e-3
        )


def test_pull_terms_by_model() -> None:
    """Descriptor counts from blocks x layers x KV tensors per rank; bytes per rank."""
    qwen = load_profile("qwen3-32b-p5en-derived").pull_model
    assert qwen.descriptors_per_block == 64 * 2 and qwen.block_size == 16
    assert qwen.rank_bytes_per_token == 32_768  # 1 KV head per rank at TP 8
    assert qwen.descriptors(24_000) == 1500 * 128
    glm = load_profile("glm5-fp8-p5en").pull_model
    assert glm.descriptors_per_block == 78 * 2 and glm.block_size == 64
    # a 24k pull: fixed + descriptors + bytes at the rank's achieved bandwidth
    expect = 3000 + 192_000 * 0.54 + 24_000 * 32_768 / 4.4e3
    assert qwen.wire_us(24_000) == pytest.approx(expect)


def test_profile_sources_are_in_the_docs() -> None:
    """Every upstream issue/PR a profile cites is cited in docs/profiles.md too."""
    doc = (REPO_ROOT / "docs" / "profiles.md").read_text()
    for name in generated_profiles():
        for src in load_profile(name).sources:
            for ref in re.findall(r"#\d+", src):
                assert ref in doc, (name, ref)


def test_old_profile_files_still_load() -> None:
    """A profile without the pull terms keeps its old meaning: fixed + bytes / bandwidth."""
    from bidir_kv.engine.profiles import CostProfile

    old = CostProfile(
        name="old",
        kv_bytes_per_token_target=1000,
        transfer_overhead_us=2000.0,
        transfer_gbytes_per_s=10.0,
    )
    assert old.transfer_seconds(1000) == pytest.approx((2000 + 1000 * 1000 / 10e3) * 1e-6)
    assert old.descriptors(1000) == 0


def cost(a=20.0, b=0.0, x=1.0, o=2000.0) -> CostModel:
    return CostModel(a, b, x, o, kv_bytes_per_token=1000.0)


def test_break_even_linear() -> None:
    # 2000 µs fixed / (20 − 1) µs saved per token
    assert break_even_tokens(cost()) == pytest.approx(2000 / 19)
    t, why = recommend_threshold(cost(), block_size=16)
    assert t == 112 and "105.3" in why
    never, why = recommend_threshold(cost(a=1.0, x=2.0))
    assert never is None and "never" in why


@pytest.mark.parametrize(
    ("fixed_us", "exact", "threshold"),
    [
        (2250.0, 112.5, 128),  # just past a block boundary: the next block, not 112
        (1930.0, 96.5, 112),
        (2240.0, 112.0, 112),  # on a boundary: that block
        (10.0, 0.5, 16),  # under one token: one whole block
    ],
)
def test_threshold_rounds_a_fractional_break_even_up_to_the_next_block(
    fixed_us: float, exact: float, threshold: int
) -> None:
    """Below the break-even a pull costs more than recomputing, so the threshold is the
    first whole block at or past it, never the block before it."""
    model = cost(a=21.0, x=1.0, o=fixed_us)  # 20 µs saved per token
    assert break_even_tokens(model) == pytest.approx(exact)
    t, why = recommend_threshold(model, block_size=16)
    assert t == threshold and f"pull pays from {exact:.1f} tokens" in why
    assert t is not None and t >= exact and t % 16 == 0


@given(
    a=st.floats(0.1, 100),
    b=st.one_of(st.just(0.0), st.floats(1e-6, 5)),
    x=st.floats(0, 50),
    o=st.floats(0, 1e5),
)
def test_break_even_is_the_crossover(a: float, b: float, x: float, o: float) -> None:
    c = cost(a, b, x, o)
    n = break_even_tokens(c)
    if math.isinf(n):
        assert b == 0 and a <= x
        return
    # at n recompute equals pull; above it pulling is cheaper, below it recomputing is
    assert c.recompute_us(n) == pytest.approx(c.pull_us(n), rel=1e-6, abs=1e-6)
    if n > 1:
        assert c.recompute_us(n * 0.5) <= c.pull_us(n * 0.5) + 1e-6
    assert c.recompute_us(n * 2 + 1) >= c.pull_us(n * 2 + 1) - 1e-6


@given(length=st.integers(200, 100_000), thr=st.integers(0, 10_000))
def test_ttft_rows(length: int, thr: int) -> None:
    c = cost(b=0.5)
    (row,) = ttft_rows(c, [length], new_tokens=150, threshold=thr, fixed_us=1000)
    assert row.history_tokens == length - 150
    assert row.pulls == (length - 150 >= thr)
    assert row.off_ms == pytest.approx((c.recompute_us(length) + 1000) / 1e3)
    if not row.pulls:
        assert row.on_ms == row.off_ms
    else:
        expect = c.pull_us(length - 150) + c.recompute_us(150, length - 150) + 1000
        assert row.on_ms == pytest.approx(expect / 1e3)
    assert row.saving_ms == pytest.approx(row.off_ms - row.on_ms)


def test_ttl_memory_littles_law() -> None:
    c = cost()
    w = Workload(
        conversations_per_s=0.5,
        turns=3,
        first_prompt_tokens=1000,
        tokens_per_turn=400,
        output_tokens=100,
        gap=Distribution.parse("const:20"),
    )
    assert w.held_tokens(1) == 1099 and w.held_tokens(3) == 1899
    short, long_ = ttl_rows(c, w, [10, 60], gpus=8)
    # TTL 10 s < gap 20 s: every follow-up misses, turns held 10 s each
    assert short.miss_fraction == 1.0
    assert short.held_tokens == pytest.approx(0.5 * (1099 + 1499 + 1899) * 10)
    # TTL 60 s: turns 1-2 held until the next turn (20 s), the last for the full TTL
    assert long_.miss_fraction == 0.0
    assert long_.held_tokens == pytest.approx(0.5 * ((1099 + 1499) * 20 + 1899 * 60))
    assert long_.held_gib == pytest.approx(long_.held_tokens * 1000 / 2**30)
    assert long_.held_gib_per_gpu == pytest.approx(long_.held_gib / 8)


@given(ttl=st.floats(0.5, 5000), gap=st.floats(0, 6000))
def test_ttl_miss_is_the_decline_rule(ttl: float, gap: float) -> None:
    """A follow-up counts as a miss exactly when P would decline D's blocks at that gap."""
    w = Workload(1.0, 2, 100, 10, 10, Distribution("const", (gap,)))
    (row,) = ttl_rows(cost(), w, [ttl])
    # D retains at 0 with deadline ttl; P reads at ``gap`` on the same clock
    declined = should_decline(remote_expiry=ttl, offset=0.0, now=gap)
    if abs(gap - max(0.0, ttl - 5.0)) > 1e-9:  # a gap exactly on the edge is the cdf's tie
        assert row.miss_fraction == (1.0 if declined else 0.0)


def test_recommend_ttl() -> None:
    c = cost()
    w = Workload(0.1, 10, 2150, 450, 300, Distribution.parse("exp:60"))
    rows = ttl_rows(c, w, [30, 60, 120, 240, 480, 960])
    best, why = recommend_ttl(rows, miss_target=0.05)
    # exp(60): P(gap > TTL - 5) <= 5% needs TTL - 5 >= 60 ln 20 ≈ 179.7 s
    assert best.ttl_s == 240 and "5%" in why
    tight, why = recommend_ttl(rows, miss_target=0.05, kv_budget_gib=rows[1].held_gib)
    assert tight.ttl_s == 60 and "budget" in why
    with pytest.raises(PlanError):
        Hardware(mfu=0)


def test_plan_cli_prints_a_plan(capsys) -> None:
    assert plan_main(["--config", str(CONFIGS / "qwen3-32b.json"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["recommended_threshold"] >= 16
    assert plan["ttft"][-1]["ratio"] > plan["ttft"][0]["ratio"] > 1
    assert plan["recommended_ttl_s"] in (30, 60, 120, 240, 480, 960, 1800)
    assert plan_main(["--config", str(CONFIGS / "glm-5-fp8.json")]) == 0
    assert "MLA" in capsys.readouterr().out
    assert plan_main([]) == 2
    assert "exactly one cost source" in capsys.readouterr().err


def test_recommend_threshold_reasons_name_every_pull_term() -> None:
    calibrated = CostModel(
        30.0,
        0.0,
        1.5,
        2500.0,
        kv_bytes_per_token=1000.0,
        xfer_us_per_descriptor=0.5,
        descriptors_per_token=10.0,
        pull_after_us_per_token=2.0,
    )
    t, why = recommend_threshold(calibrated, block_size=16)
    assert (
        t == 128
        and "a pull costs 2500 µs fixed + 8.500 µs/token (bytes 1.500, "
        "descriptors 5.000, P's work around the READ 2.000), recompute costs 30.000"
        in why
    )
    t, why = recommend_threshold(CostModel(30.0, 0.0, 1.5, 2500.0, kv_bytes_per_token=1000.0))
    assert t == 96 and "+ 1.500 µs/token, recompute costs 30.000 µs/token" in why
    never, why = recommend_threshold(CostModel(1.0, 0.0, 2.0, 2500.0, kv_bytes_per_token=1.0))
    assert never is None and why == (
        "pulling never pays: per-token transfer (2.00 µs) is not cheaper than recompute — keep "
        "bidirectional_kv_xfer off, or make pulls cheaper (bandwidth, fewer descriptors)"
    )
    # a pull that costs nothing fixed pays from the first token: at least 1, a whole block
    free = CostModel(30.0, 0.0, 1.5, 0.0, kv_bytes_per_token=1.0)
    assert recommend_threshold(free, block_size=1)[0] == 1
    assert recommend_threshold(free, block_size=16)[0] == 16


def _row(ttl: float, miss: float, gib: float) -> TtlRow:
    return TtlRow(ttl, miss, held_tokens=0.0, held_gib=gib, held_gib_per_gpu=gib / 8)


def test_recommend_ttl_each_branch() -> None:
    rows = [_row(480, 0.01, 40.0), _row(60, 0.2, 5.0), _row(120, 0.05, 10.0), _row(240, 0.03, 20.0)]
    best, why = recommend_ttl(rows, miss_target=0.05)  # exactly on the target: meets it
    assert best.ttl_s == 120 and why.startswith("the smallest TTL whose expiry miss rate (5.0%)")
    best, why = recommend_ttl(rows, miss_target=0.001, kv_budget_gib=25.0)  # none meets it
    assert best.ttl_s == 240 and "the largest one that fits misses 3.0%" in why
    best, why = recommend_ttl(rows, miss_target=0.05, kv_budget_gib=1.0)  # none fits
    assert best.ttl_s == 60
    assert why.startswith("even the smallest TTL exceeds the KV memory budget; add D capacity. ")
    with pytest.raises(PlanError, match=r"^no TTL candidates$"):
        recommend_ttl([], miss_target=0.05)


def test_hardware_terms_and_notes() -> None:
    qwen = shape("qwen3-32b")
    pm = Hardware(block_size=32, rails_per_gpu=2).pull_model(qwen)
    assert (pm.block_size, pm.rank_gbytes_per_s) == (32, pytest.approx(8.8))
    c = CostModel.from_hardware(qwen, Hardware())
    assert c.source == "hardware" and c.sources == ()
    hw = Hardware()
    assert c.recompute_us_per_token_ctx == pytest.approx(
        qwen.context_flops_per_token() * 1000 / hw.flops_per_s * 1e6, rel=1e-12
    )
    assert c.notes[0] == "qwen3-32b: GQA, 64 layers, 32.0B active of 32.8B params"
    d = c.to_dict()
    assert d["notes"] == list(c.notes) and d["sources"] == []
    assert set(d) == set(CostModel.__dataclass_fields__)


def test_bad_figures_are_refused_by_name_and_the_edges_allowed() -> None:
    # the per-pull terms may be 0 (a target without them); every other figure may not
    Hardware(per_descriptor_us=0, pull_overhead_us=0, step_us=0, handshake_us=0, mfu=1.0)
    with pytest.raises(PlanError, match=r"^hardware figure gpus must be > 0, got 0$"):
        Hardware(gpus=0)
    with pytest.raises(PlanError, match=r"^mfu is a fraction in \(0, 1\]$"):
        Hardware(mfu=1.5)
    gap = Distribution.parse("const:60")
    one_turn = Workload(1e-6, 1, 100, 10, 10, gap)  # a single turn is a workload
    with pytest.raises(PlanError, match=r"^conversation rate must be > 0$"):
        Workload(0.0, 2, 100, 10, 10, gap)
    with pytest.raises(PlanError, match=r"^turns must be >= 1$"):
        Workload(1.0, 0, 100, 10, 10, gap)
    (row,) = ttl_rows(cost(), one_turn, [30.0])  # 8 GPUs unless told
    # no next turn to miss, however long the gap
    assert row.miss_fraction == 0.0 and row.held_gib_per_gpu == pytest.approx(row.held_gib / 8)
    with pytest.raises(PlanError, match=r"^TTL must be > 0, got 0$"):
        ttl_rows(cost(), one_turn, [0])


def test_ttft_rows_edges() -> None:
    c = cost(b=0.5)
    short, one = ttft_rows(c, [100, 1], new_tokens=150, threshold=0)  # nothing else common
    assert (short.history_tokens, short.pulls) == (0, False)
    assert short.off_ms == pytest.approx(c.recompute_us(100) / 1e3) == short.on_ms
    assert one.prompt_tokens == 1
    with pytest.raises(PlanError, match=r"^prompt length must be > 0, got 0$"):
        ttft_rows(c, [0], new_tokens=1, threshold=0)


def test_cost_terms_at_their_edges() -> None:
    with pytest.raises(PlanError, match=r"^xfer_us_per_token must be >= 0, got nan$"):
        CostModel(1.0, 0.0, math.nan, 0.0, kv_bytes_per_token=1.0)
    with pytest.raises(PlanError, match=r"^recompute cost must be > 0 \(both recompute terms"):
        CostModel(0.0, 0.0, 1.0, 0.0, kv_bytes_per_token=1.0)
    ctx_only = CostModel(0.0, 0.5, 1.0, 2500.0, kv_bytes_per_token=1.0)  # attention alone
    assert ctx_only.recompute_us(-5) == 0.0 and ctx_only.pull_us(0) == 0.0  # no fixed part
    assert ctx_only.pull_us(1) == 2501.0
    timed = CostModel(
        1.0,
        0.0,
        1.0,
        0.0,
        kv_bytes_per_token=1.0,
        decode_ttft_fixed_us=900.0,
        decode_ttft_us_per_token=2.0,
        prefill_fixed_us=7000.0,
    )
    assert timed.decode_ttft_us(0) == 900.0 and timed.decode_ttft_us(10) == 920.0
    (row,) = ttft_rows(timed, [100], new_tokens=10, threshold=10**6, fixed_us=50.0)
    assert row.off_ms == pytest.approx((100 * 1.0 + 50.0 + 7000.0 + 900.0 + 200.0) / 1e3)
    assert row.ratio == 1.0  # no pull: both legs the same
    tiny = CostModel(1e-4, 0.0, 1.0, 0.0, kv_bytes_per_token=1.0)  # under a µs in all
    (row,) = ttft_rows(tiny, [1], new_tokens=1, threshold=10**6)
    assert row.ratio == 1.0


def test_break_even_root_without_cancellation() -> None:
    # q n² + lin n − o = 0 with lin² ≫ 4qo: the root is o/lin to 12 digits; the other
    # form of the root (disc − lin) / 2q loses 5 of them
    c = CostModel(2.0, 2e-9, 1.0, 1.0, kv_bytes_per_token=1.0)  # lin = 1, q = 1e-12, o = 1
    assert break_even_tokens(c) == pytest.approx(1 / (1 + 1e-12), rel=1e-12)


def test_ttft_rows_ps_own_hit_is_none() -> None:
    # block size 1: every token is a block, so P's hit must be 0 for the whole history
    c = cost(b=0.5)
    (row,) = ttft_rows(c, [1000], new_tokens=100, threshold=0, block_size=1)
    assert row.pulls
    assert row.on_ms == pytest.approx((c.pull_us(900) + c.recompute_us(100, 900)) / 1e3)
