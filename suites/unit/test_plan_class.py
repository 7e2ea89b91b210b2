"""Issue 35: the planner predicts a model it was not fitted on.

* compute by model class: public measurements converted to a share of the FP8 peak,
  the class's median and the regime's spread (bidir_kv/plan/sources.py);
* KV bytes and descriptors as vLLM serves them (kv_cache_dtype, fp8_ds_mla, the
  indexer's keys, the sparse-MLA block size);
* ranges, not points: every answer over the corners of the terms' ranges, the dominant
  term, and whether a threshold holds (bidir_kv/plan/ranges.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from bidir_kv.engine.profiles import ProfileError, TermRange, load_profile
from bidir_kv.paths import REPO_ROOT
from bidir_kv.plan.cli import main as plan_main
from bidir_kv.plan.derive import descriptor_split, predicted_cost
from bidir_kv.plan.modelcfg import ModelConfigError, shipped_shape
from bidir_kv.plan.planner import CostModel, PlanError, break_even_tokens
from bidir_kv.plan.predict import cost_from_profile
from bidir_kv.plan.ranges import (
    break_even_spread,
    corners,
    scaled,
    spread,
    threshold_check,
    ttft_spreads,
)
from bidir_kv.plan.sources import (
    BOUNDS,
    EP_BATCH,
    MEASUREMENTS,
    SERIAL,
    Measurement,
    class_rate,
    prefill_flops_per_token,
)

# ---- KV as served -------------------------------------------------------------------


def test_kv_cache_dtype_auto_is_the_model_dtype_and_fp8_is_ds_mla_for_sparse_mla() -> None:
    auto = shipped_shape("glm-5-fp8")
    assert auto.kv_cache_dtype == "bfloat16"
    # latent 512 + 64 in bf16, indexer keys 128 FP8 + one float32 scale, per layer
    assert auto.kv_bytes_per_token_per_rank(8) == 78 * ((512 + 64) * 2 + 132) == 100_152
    fp8 = shipped_shape("glm-5-fp8", "fp8")
    assert fp8.kv_cache_dtype == "fp8_ds_mla"
    # vLLM's fp8_ds_mla: 512 FP8 + 4 float32 scales + 64 bf16 RoPE = 656 B per layer
    assert fp8.kv_bytes_per_token_per_rank(8) == 78 * (656 + 132) == 61_464
    # the latent is replicated on every rank: the group holds 8 copies
    assert fp8.kv_bytes_per_token(8) == 8 * 61_464
    # a dense MLA model's FP8 cache is one byte per latent value
    assert shipped_shape("deepseek-v3", "fp8").kv_bytes_per_token_per_rank(8) == 61 * 576
    assert shipped_shape("deepseek-v3").kv_bytes_per_token_per_rank(8) == 61 * 576 * 2
    with pytest.raises(ModelConfigError, match="fp8_ds_mla is only for sparse-MLA"):
        shipped_shape("qwen3-32b", "fp8_ds_mla")
    with pytest.raises(ModelConfigError, match="KV cache dtype 'int3' unknown"):
        shipped_shape("qwen3-32b", "int3")


def test_sparse_mla_is_served_with_64_token_blocks_and_two_regions_per_layer() -> None:
    glm, qwen = shipped_shape("glm-5-fp8"), shipped_shape("qwen3-32b")
    assert glm.served_block_size(16) == 64
    assert qwen.served_block_size(16) == 16
    assert shipped_shape("deepseek-v3").served_block_size(16) == 16
    assert glm.kv_tensors_per_layer() == 2  # latent + indexer keys
    # sparse MLA attends in the latent: keys 512 + 64, values 512, 64 heads, 78 layers
    assert glm.attention_flops_per_context_token() == 2 * 78 * 64 * (576 + 512)
    # dense MLA prefill runs on the decompressed heads: qk 128 + 64, v 128
    assert shipped_shape("deepseek-v3").attention_flops_per_context_token() == (
        2 * 61 * 128 * (192 + 128)
    )


def test_shipped_class_models_reproduce_their_model_cards() -> None:
    v3 = shipped_shape("deepseek-v3")
    assert v3.total_params == pytest.approx(671e9, rel=0.01)
    assert v3.active_params == pytest.approx(37e9, rel=0.03)
    assert shipped_shape("deepseek-v3.2").index_n_heads == 64


def test_plan_config_uses_the_served_block_size_and_kv_cache_dtype(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = REPO_ROOT / "bidir_kv/data/model_configs/glm-5-fp8.json"
    assert plan_main(["--config", str(cfg), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["block_size"] == 64
    assert plan["cost_model"]["kv_bytes_per_token"] == 8 * 100_152
    assert plan_main(["--config", str(cfg), "--kv-cache-dtype", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cost_model"]["kv_bytes_per_token"] == 8 * 61_464


# ---- compute by class ----------------------------------------------------------------


def _measurement(**kw: object) -> Measurement:
    base = dict(
        key="m",
        config="glm-5-fp8",
        model="m",
        model_class="moe-mla-dsa",
        hardware="8x H200",
        gpus=8,
        parallelism="TP 8",
        precision="FP8",
        engine="e",
        regime=SERIAL,
        figure="f",
        url="u",
        date="d",
        prompt_tokens=8000,
        us_per_token=(100.0, 100.0),
        conversion="c",
    )
    base.update(kw)
    return Measurement(**base)  # type: ignore[arg-type]


def test_a_measurement_converts_to_a_share_of_the_fp8_peak() -> None:
    m = _measurement(us_per_token=(100.0, 200.0))
    glm = shipped_shape("glm-5-fp8")
    flops = prefill_flops_per_token(glm, 8000)
    assert flops == glm.linear_flops_per_token() + glm.context_flops_per_token() * 4000
    peak = 8 * 1979e12
    lo, hi = m.fraction_of_peak()
    assert hi == pytest.approx(flops / (100e-6 * peak))  # the faster figure, the higher share
    assert lo == pytest.approx(flops / (200e-6 * peak))
    assert m.midpoint() == pytest.approx(math.sqrt(lo * hi))
    with pytest.raises(PlanError, match="0 < low <= high"):
        _measurement(us_per_token=(200.0, 100.0))


def test_the_class_rate_is_the_median_of_its_own_sources_and_the_regime_spread() -> None:
    a = _measurement(key="a", us_per_token=(100.0, 100.0))
    b = _measurement(key="b", us_per_token=(200.0, 200.0))
    c = _measurement(key="c", us_per_token=(150.0, 150.0))
    other = _measurement(key="dense", model_class="moe-mla", us_per_token=(50.0, 50.0))
    rate = class_rate("moe-mla-dsa", measurements=(a, b, c, other), bounds=())
    assert rate.center == pytest.approx(c.midpoint())  # the median of a, b, c
    assert rate.low == pytest.approx(b.fraction_of_peak()[0])
    # the regime's most efficient source sets the high end, whatever its class
    assert rate.high == pytest.approx(other.fraction_of_peak()[1])
    assert rate.sources == ("a", "b", "c")
    lo, hi = rate.factors()
    assert lo < 1 < hi and hi == pytest.approx(rate.center / rate.low)
    with pytest.raises(PlanError, match="no public measurement of class"):
        class_rate("dense-gqa", measurements=(a, b), bounds=())
    # a bound of a more efficient regime below the spread means the sources disagree
    slow_bound = _measurement(key="ep", regime=EP_BATCH, us_per_token=(80.0, 80.0))
    with pytest.raises(PlanError, match="bound ep"):
        class_rate("moe-mla-dsa", measurements=(a, b, other), bounds=(slow_bound,))


def test_the_shipped_sources_are_consistent_and_give_the_glm_rate() -> None:
    rate = class_rate("moe-mla-dsa")
    assert set(rate.sources) == {m.key for m in MEASUREMENTS if m.model_class == "moe-mla-dsa"}
    assert len(rate.sources) >= 3  # several sources, not one
    assert all(m.url and m.date and m.conversion for m in MEASUREMENTS + BOUNDS)
    # every expert-parallel, large-batch bound is more efficient than the serial spread
    assert all(b.fraction_of_peak()[0] > rate.high for b in BOUNDS)
    glm = predicted_cost().cost
    flops = shipped_shape("glm-5-fp8").linear_flops_per_token()
    assert glm.recompute_us_per_token == pytest.approx(flops / (8 * 1979e12 * rate.center) * 1e6)
    # the Qwen3-32B share of the BF16 peak does not carry over: a GLM-5 token costs more
    # than a Qwen3-32B token (the publication's own explanation of its larger gain)
    qwen = load_profile("qwen3-32b-p5en")
    assert glm.recompute_us_per_token > qwen.prefill_us_per_token


def test_the_descriptor_split_reproduces_both_lmcache_sizes() -> None:
    tau, rate = descriptor_split()
    assert 4096 / (tau * 1e3 + 4096 / rate) == pytest.approx(4.69)
    assert 262_144 / (tau * 1e3 + 262_144 / rate) == pytest.approx(12.2)


# ---- ranges ---------------------------------------------------------------------------


def _cost(**kw: object) -> CostModel:
    base = dict(
        recompute_us_per_token=100.0,
        recompute_us_per_token_ctx=1.0,
        xfer_us_per_token=5.0,
        pull_overhead_us=10_000.0,
        kv_bytes_per_token=1e5,
        xfer_us_per_descriptor=0.4,
        descriptors_per_token=2.0,
        pull_after_us_per_token=6.0,
        prefill_fixed_us=80_000.0,
        decode_ttft_us_per_token=1.0,
    )
    base.update(kw)
    return CostModel(**base)  # type: ignore[arg-type]


def test_scaled_multiplies_exactly_the_named_term() -> None:
    c = _cost()
    r = scaled(c, "recompute", 2.0)
    assert (r.recompute_us_per_token, r.recompute_us_per_token_ctx) == (200.0, 2.0)
    assert r.pull_us_per_token == c.pull_us_per_token
    p = scaled(c, "pull", 2.0)
    assert p.pull_us_per_token == pytest.approx(2 * (5.0 + 0.8) + 6.0)
    assert scaled(c, "pull_after", 0.5).pull_after_us_per_token == 3.0
    assert scaled(c, "pull_fixed", 0.5).pull_overhead_us == 5_000.0
    assert scaled(c, "prefill_fixed", 2.0).prefill_fixed_us == 160_000.0
    assert scaled(c, "decode_part", 3.0).decode_ttft_us_per_token == 3.0
    with pytest.raises(PlanError, match="no cost term"):
        scaled(c, "network", 2.0)


def test_a_range_spans_every_corner_and_names_the_dominant_term() -> None:
    c = _cost(
        uncertainty=(
            TermRange("recompute", 0.5, 1.5),
            TermRange("pull", 0.9, 1.1),
            TermRange("prefill_fixed", 0.5, 2.0),
        )
    )
    assert len(corners(c)) == 8
    be = break_even_spread(c)
    # break-even: fastest recompute with slowest pull, and the reverse; the per-request
    # part moves both legs alike and so never the break-even
    slow = replace(c, recompute_us_per_token=50.0, recompute_us_per_token_ctx=0.5)
    slow = scaled(slow, "pull", 1.1)
    assert be.high == pytest.approx(break_even_tokens(slow))
    assert be.low < be.center < be.high
    assert be.dominant == "recompute"
    assert be.swings["prefill_fixed"] == 0.0
    # OFF/ON at a long prompt: also decided by recompute here
    row = ttft_spreads(c, [20_000], 150, 128)[0]
    assert row.ratio.low < row.ratio.center < row.ratio.high
    assert row.off_ms.dominant == "recompute"
    # a point estimate has no range and no dominant term
    point = spread(_cost(), break_even_tokens)
    assert point.point and point.low == point.center == point.high


def test_a_threshold_holds_only_when_every_corner_pays_from_it() -> None:
    c = _cost(uncertainty=(TermRange("recompute", 0.5, 1.5),))
    be = break_even_spread(c)
    ok = threshold_check(c, 64 * math.ceil(be.high / 64), block_size=64)
    assert ok.holds and "holds across the range" in ok.text
    bad = threshold_check(c, 64, block_size=64)
    assert not bad.holds
    assert bad.robust_threshold == 64 * math.ceil(be.high / 64)
    assert f"a threshold of {bad.robust_threshold} holds" in bad.text
    assert "recompute x0.5" in bad.text
    # at some corner pulls never pay: no threshold holds
    never = _cost(recompute_us_per_token_ctx=0.0, uncertainty=(TermRange("recompute", 0.05, 1.0),))
    assert math.isinf(break_even_spread(never).high)
    nv = threshold_check(never, 128)
    assert not nv.holds and nv.robust_threshold is None and "never pay" in nv.text
    # leaving the feature off holds only if pulling pays at no corner
    off = threshold_check(c, None)
    assert not off.holds and "does not hold" in off.text


def test_term_ranges_are_validated_and_load_from_a_profile(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="uncertainty term 'network' unknown"):
        TermRange("network", 0.5, 2.0)
    with pytest.raises(ProfileError, match="0 < low <= 1 <= high"):
        TermRange("pull", 1.2, 2.0)
    base = {"name": "x", "prefill_us_per_token": 10.0, "kv_bytes_per_token": 64}
    path = tmp_path / "x.json"
    path.write_text(json.dumps({**base, "uncertainty": [{"term": "pull", "low": 0.5}]}))
    with pytest.raises(ProfileError, match="needs term, low, high"):
        load_profile(str(path))
    twice = [{"term": "pull", "low": 0.5, "high": 2}] * 2
    path.write_text(json.dumps({**base, "uncertainty": twice}))
    with pytest.raises(ProfileError, match="given twice"):
        load_profile(str(path))
    path.write_text(json.dumps({**base, "uncertainty": twice[:1]}))
    cost = cost_from_profile(str(path))
    assert cost is not None and cost.uncertainty == (TermRange("pull", 0.5, 2.0),)


def test_plan_prints_ranges_the_dominant_term_and_whether_the_threshold_holds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert plan_main(["--profile", "glm5-fp8-p5en", "--prompt-lengths", "2000,20000"]) == 0
    out = capsys.readouterr().out
    assert "over the terms' ranges; dominant term: recompute" in out
    assert "across the ranges: " in out and "holds across the range" in out
    assert "OFF/ON" in out and "- recompute: x" in out
    assert plan_main(["--profile", "glm5-fp8-p5en", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    rng = plan["ranges"]
    assert rng["break_even"]["low"] <= plan["break_even_tokens"] <= rng["break_even"]["high"]
    assert {t["term"] for t in rng["terms"]} >= {"recompute", "pull", "pull_after"}
    assert isinstance(rng["threshold_holds"], bool)
    assert plan["block_size"] == 64  # the profile's block, not the engine default
    # a profile without ranges prints a point and no range table
    assert plan_main(["--profile", "qwen3-32b-p5en"]) == 0
    out = capsys.readouterr().out
    assert "over the terms' ranges" not in out
    assert plan_main(["--profile", "qwen3-32b-p5en", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranges"] is None


def test_plan_config_takes_a_measured_class_rate_with_its_range(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configs = REPO_ROOT / "bidir_kv/data/model_configs"
    assert plan_main(["--config", str(configs / "glm-5-fp8.json"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    rate = class_rate("moe-mla-dsa")
    assert plan["cost_model"]["recompute_us_per_token"] == pytest.approx(
        predicted_cost().cost.recompute_us_per_token
    )
    assert [t["term"] for t in plan["ranges"]["terms"]] == ["recompute"]
    assert plan["ranges"]["terms"][0]["high"] == pytest.approx(rate.factors()[1], rel=1e-3)
    # a model of no measured class keeps the stated assumption, as a point
    assert plan_main(["--config", str(configs / "qwen3-32b.json"), "--json"]) == 0
    qwen = json.loads(capsys.readouterr().out)
    assert qwen["ranges"] is None and "MFU 0.4" in " ".join(qwen["cost_model"]["notes"])
    # an explicit --mfu is the user's figure: no class, no range
    argv = ["--config", str(configs / "glm-5-fp8.json"), "--mfu", "0.2", "--json"]
    assert plan_main(argv) == 0
    assert json.loads(capsys.readouterr().out)["ranges"] is None
