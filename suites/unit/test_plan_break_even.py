"""The planner's break-even pinned to an independent computation of its terms.

The cost of each way of getting ``n`` tokens of KV onto P is written out here
term by term from the figures it is made of (a target's hardware and model shape,
or a calibrated profile's fields), without the planner's own ``pull_us`` or
``recompute_us``; the crossing point is found by bisection and must be where the
planner puts its break-even. A planner that drops one term of the pull cost (the
wait for P's next step, the descriptors, P's work per pulled token) or of the
recompute cost moves its break-even off the crossing point.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bidir_kv.paths import REPO_ROOT
from bidir_kv.plan.modelcfg import load_model_config, model_shape
from bidir_kv.plan.planner import CostModel, Hardware, break_even_tokens

CONFIGS = REPO_ROOT / "bidir_kv" / "data" / "model_configs"


def _crossing(pull: Callable[[float], float], recompute: Callable[[float], float]) -> float:
    """The ``n`` where recomputing starts to cost as much as pulling (bisection)."""
    lo, hi = 1e-9, 1.0
    while recompute(hi) < pull(hi):
        hi *= 2
        assert hi < 1e12, "recompute never catches up with the pull"
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if recompute(mid) < pull(mid) else (lo, mid)
    return (lo + hi) / 2


def test_break_even_from_a_targets_hardware_and_shape() -> None:
    hw = Hardware()  # every pull term non-zero: overhead, descriptors, bytes, P's step
    shape = model_shape(load_model_config(CONFIGS / "qwen3-32b.json"))
    assert hw.step_us > 0 and hw.per_descriptor_us > 0 and hw.pull_overhead_us > 0
    flops_per_us = hw.gpus * hw.peak_tflops_per_gpu * 1e12 * hw.mfu / 1e6
    rank_bytes = shape.kv_bytes_per_token_per_rank(hw.gpus)
    bytes_per_us = hw.rail_gbytes_per_s * hw.rails_per_gpu * 1e9 / 1e6
    descriptors_per_token = shape.num_layers * shape.kv_tensors_per_layer() / hw.block_size

    def pull(n: float) -> float:
        wait_for_next_step = hw.step_us / 2  # the completion is seen at P's next step
        return (
            hw.pull_overhead_us
            + wait_for_next_step
            + n * rank_bytes / bytes_per_us
            + n * descriptors_per_token * hw.per_descriptor_us
        )

    def recompute(n: float, context: float = 0.0) -> float:
        avg_ctx = context + n / 2
        return (
            n
            * (shape.linear_flops_per_token() + shape.context_flops_per_token() * avg_ctx)
            / flops_per_us
        )

    cost = CostModel.from_hardware(shape, hw)
    assert break_even_tokens(cost) == pytest.approx(_crossing(pull, recompute), rel=1e-6)
    for ctx in (1000.0, 8000.0):
        expect = _crossing(pull, lambda n, c=ctx: recompute(n, c))
        assert break_even_tokens(cost, ctx) == pytest.approx(expect, rel=1e-6)


def test_break_even_from_a_calibrated_profiles_terms() -> None:
    # a calibration's fields, every one that enters the pull cost set
    terms = {
        "recompute_us_per_token": 30.0,
        "recompute_us_per_token_ctx": 0.4,
        "xfer_us_per_token": 1.5,
        "pull_overhead_us": 2500.0,
        "xfer_us_per_descriptor": 0.5,
        "descriptors_per_token": 10.0,
        "step_us": 4000.0,
        "pull_after_us_per_token": 2.0,
        "prefill_fixed_us": 7000.0,
        "decode_ttft_fixed_us": 900.0,
    }
    cost = CostModel(kv_bytes_per_token=1000.0, **terms)

    def pull(n: float) -> float:
        return (
            terms["pull_overhead_us"]
            + terms["step_us"] / 2
            + n
            * (
                terms["xfer_us_per_token"]
                + terms["descriptors_per_token"] * terms["xfer_us_per_descriptor"]
                + terms["pull_after_us_per_token"]
            )
        )

    def recompute(n: float) -> float:  # prefill_fixed_us is paid by both legs alike
        return n * (
            terms["recompute_us_per_token"] + terms["recompute_us_per_token_ctx"] * (n / 2) / 1000
        )

    assert break_even_tokens(cost) == pytest.approx(_crossing(pull, recompute), rel=1e-6)
    # no attention term: the closed form is the fixed part over the per-token saving
    flat = CostModel(kv_bytes_per_token=1000.0, **{**terms, "recompute_us_per_token_ctx": 0.0})
    fixed = terms["pull_overhead_us"] + terms["step_us"] / 2
    saving = terms["recompute_us_per_token"] - (
        terms["xfer_us_per_token"]
        + terms["descriptors_per_token"] * terms["xfer_us_per_descriptor"]
        + terms["pull_after_us_per_token"]
    )
    assert break_even_tokens(flat) == pytest.approx(fixed / saving, rel=1e-9)
