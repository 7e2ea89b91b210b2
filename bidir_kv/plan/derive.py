"""The shipped emulator profiles, generated with their sources: derived, calibrated, predicted.

``bidir_kv/data/profiles/*-p5en*.json`` are *outputs* of this module, never edited by
hand: ``python -m bidir_kv.plan.derive --write`` regenerates them (in the checkout),
and ``suites/unit/test_bench_plan.py::test_profiles_match_the_generation`` fails when
a file and this module drift apart. Three kinds (docs/profiles.md):

* **derived** (``qwen3-32b-p5en-derived``): first principles, from a model's
  ``config.json`` and cited hardware figures (``CostModel.from_hardware``);
* **calibrated** (``qwen3-32b-p5en``): the terms fitted to a published table
  (``bidir_kv.plan.published``) by the fit behind ``plan --calibration``;
* **predicted** (``glm5-fp8-p5en``): another model's config with the calibrated
  profile's hardware terms, fitted to nothing of its own.

The planner and the emulator (``CostProfile.pull_model``) evaluate the same terms,
so the planner's prediction and the emulator agree by construction.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from importlib.resources import as_file
from pathlib import Path
from typing import Any

from bidir_kv.engine.profiles import PROFILE_DIR, TermRange
from bidir_kv.plan.calibrate import FitInput, fit, residuals
from bidir_kv.plan.modelcfg import ModelShape, shipped_shape
from bidir_kv.plan.planner import CostModel, Hardware
from bidir_kv.plan.published import PublishedTable, fit_input, load_table
from bidir_kv.plan.sources import FP8_PEAK_TFLOPS, GLM_FIXED, ClassRate, class_rate

__all__ = [
    "CALIBRATED",
    "PREDICTED",
    "TARGETS",
    "Target",
    "calibrated_cost",
    "calibrated_input",
    "calibrated_profile",
    "derive_profile",
    "generated_profiles",
    "predicted_profile",
    "profile_fields",
    "target_shape",
]

ALLREDUCE_US = 10.0  # one small tensor-parallel all-reduce inside a node (NVLink), assumption
HBM_EFFICIENCY = 0.7  # achieved fraction of HBM bandwidth when streaming weights, assumption

_NET = (
    "rail 4.4 GB/s per rank-level transfer: vLLM issue #50913 (3P1D H200: 167 MB in 38.7 ms "
    "per transfer = 4.3 GB/s, 1,785 descriptors of ~94 KB) and llm-d's GLM-5.2 H200 results "
    "(~4.5 GB/s above the session floor)",
    "rails per rank 1: assumption (LMCache PR #4161: with 4 KiB descriptors NIXL/UCX put no "
    "READ payload on a second rail)",
    "0.54 µs per descriptor: LMCache PR #4161, NIXL/UCX READ on one rail, 4 KiB descriptors "
    "4.69 GB/s vs 12.2 GB/s with 256 KiB ones: 0.874 - 0.336 µs per 4 KiB",
    "3 ms fixed per pull: vLLM issue #23780 (~3 ms to launch a transfer per request)",
    "idle step 1 ms: assumption (P notices the READ's completion at an engine step)",
    "handshake 6 s on the first pull of a pair: llm-d's GLM-5.2 H200 results",
    "decode: active weights / GPUs / (4.8 TB/s x 0.7) + 2 all-reduces x 10 µs per layer: "
    "assumptions",
)


@dataclass(frozen=True)
class Target:
    """One shipped profile: which model, on what, and why each number."""

    profile: str
    config: str  # bidir_kv/data/model_configs/<config>.json
    description: str
    hardware: Hardware
    weight_bytes_per_param: float
    decode_us_per_seq: float
    sources: tuple[str, ...]


def target_shape(config: str) -> ModelShape:
    return shipped_shape(config)


def _targets() -> dict[str, Target]:
    qwen = Target(
        profile="qwen3-32b-p5en-derived",
        config="qwen3-32b",
        description="Qwen3-32B bf16, TP 8 on p5en.48xlarge (8x H200), D->P NIXL READs over "
        "EFA (the AWS blog's 1P1D), derived from first principles (compare qwen3-32b-p5en, "
        "calibrated on the published figures)",
        hardware=Hardware(),
        weight_bytes_per_param=2.0,
        decode_us_per_seq=60.0,
        sources=(
            "shape: bidir_kv/data/model_configs/qwen3-32b.json (Qwen/Qwen3-32B config.json: "
            "64 layers, 8 KV heads, head_dim 128, bf16)",
            "H200 dense BF16 989 TFLOP/s, HBM 4.8 TB/s: NVIDIA H200 datasheet",
            "prefill MFU 0.40: assumption",
            "descriptors: 64 layers x 2 (K, V) per 16-token block per rank; 1 KV head per rank "
            "at TP 8, 4 KiB each (vLLM NIXL connector layout)",
            *_NET,
        ),
    )
    glm = Target(
        profile="glm5-fp8-p5en",
        config="glm-5-fp8",
        description="GLM-5-FP8 (744B MoE, 40B active, MLA + sparse attention), TP 8 on "
        "p5en.48xlarge, D->P NIXL READs over EFA; compute predicted from public prefill "
        "measurements of its model class, KV as vLLM 0.29 serves it, the deployment terms "
        "from the published Qwen3-32B fit (fitted to no GLM-5 figure); ranges per term",
        hardware=Hardware(peak_tflops_per_gpu=1979.0, block_size=64),
        weight_bytes_per_param=1.0,
        decode_us_per_seq=100.0,
        sources=(
            "shape: bidir_kv/data/model_configs/glm-5-fp8.json (MLA latent 512 + rope 64, "
            "indexer keys 128 FP8, 78 layers, 256 experts 8 active + 1 shared; checked against "
            "the model card's 744B / 40B)",
            "H200 dense FP8 1979 TFLOP/s, HBM 4.8 TB/s: NVIDIA H200 datasheet",
            "kv_cache_dtype auto = the model dtype, bfloat16 (vLLM 0.29 utils/torch_utils.py: "
            "auto is resolved from the checkpoint only for a ModelOpt kv_cache_quant_algo or an "
            "llm-compressor kv_cache_scheme; the recipe passes no --kv-cache-dtype)",
            "block size 64: vLLM 0.29's sparse-MLA backends on Hopper (FLASH_ATTN_MLA_SPARSE, "
            "FLASHMLA_SPARSE) support only 64-token blocks and the server picks it when "
            "--block-size is not given",
            "descriptors: 78 layers x 2 (latent, indexer keys) per 64-token block per rank: "
            "vLLM 0.29's NIXL worker registers one region per layer cache, the DSA indexer's "
            "caches as their own regions",
            "handshake 6 s on the first pull of a pair: llm-d's GLM-5.2 H200 results",
            "decode: active weights / GPUs / (4.8 TB/s x 0.7) + 2 all-reduces x 10 µs per layer: "
            "assumptions",
        ),
    )
    return {t.profile: t for t in (qwen, glm)}


_ALL_TARGETS = _targets()
# first-principles profiles (the GLM-5 target is the predicted profile's model and compute)
TARGETS: dict[str, Target] = {"qwen3-32b-p5en-derived": _ALL_TARGETS["qwen3-32b-p5en-derived"]}
GLM = _ALL_TARGETS["glm5-fp8-p5en"]


def profile_fields(
    shape: ModelShape, hw: Hardware, weight_bytes_per_param: float = 2.0, **extra: Any
) -> dict[str, Any]:
    """CostProfile fields for the emulator, derived like the planner derives its costs.

    Decode (batch 1) streams the active weights once per step from HBM and does two
    TP all-reduces per layer.
    """
    cost = CostModel.from_hardware(shape, hw)
    pm = hw.pull_model(shape)
    weights_bytes = shape.active_params * weight_bytes_per_param / hw.gpus
    decode_us = weights_bytes / (hw.hbm_gbytes_per_s * 1e9 * HBM_EFFICIENCY) * 1e6
    decode_us += shape.num_layers * 2 * ALLREDUCE_US
    out = {
        "prefill_us_per_token": round(cost.recompute_us_per_token, 3),
        "prefill_us_per_token_ctx": round(cost.recompute_us_per_token_ctx, 4),
        "decode_us_per_step": round(decode_us, 1),
        "kv_bytes_per_token_target": round(cost.kv_bytes_per_token),
        "transfer_overhead_us": pm.fixed_us,
        "transfer_gbytes_per_s": round(pm.rank_gbytes_per_s * hw.gpus, 3),
        "transfer_per_descriptor_us": pm.per_descriptor_us,
        "rail_gbytes_per_s": hw.rail_gbytes_per_s,
        "rails_per_rank": hw.rails_per_gpu,
        "tp_size": hw.gpus,
        "target_block_size": pm.block_size,
        "descriptors_per_block": pm.descriptors_per_block,
        "step_us": pm.step_us,
        "handshake_us": pm.handshake_us,
    }
    out.update(extra)
    return out


def derive_profile(target: Target) -> dict[str, Any]:
    """The whole JSON object of ``bidir_kv/data/profiles/<target.profile>.json``."""
    shape = target_shape(target.config)
    fields = profile_fields(shape, target.hardware, target.weight_bytes_per_param)
    return {
        "name": target.profile,
        "description": target.description,
        **fields,
        "decode_us_per_seq": target.decode_us_per_seq,
        "max_num_batched_tokens": 8192,
        "kv_bytes_per_token": 256,
        "num_layers": 4,
        "time_scale": 1.0,
        "sources": list(target.sources),
        "derivation": "generated by bidir_kv.plan.derive (python -m bidir_kv.plan.derive "
        "--write); every term is derived in docs/profiles.md",
    }


# ---- calibrated: the published table, fitted -----------------------------------------

CALIBRATED = "qwen3-32b-p5en"  # the profile a published table calibrates
PREDICTED = "glm5-fp8-p5en"  # the profile predicted with its hardware terms


def _table() -> PublishedTable:
    table = load_table(CALIBRATED)
    if table is None:
        raise FileNotFoundError(f"bidir_kv/data/published/{CALIBRATED}.json is missing")
    return table


def _table_decode_us(table: PublishedTable) -> float:
    """The emulated decode step with the table's clients in D's batch (the derivation of
    docs/profiles.md §3; the table has no decode figure)."""
    target = _ALL_TARGETS["qwen3-32b-p5en-derived"]
    step = round(_decode_us(target_shape(target.config), target.hardware, 2.0), 1)
    return step + target.decode_us_per_seq * (table.num_clients - 1)


def calibrated_input() -> tuple[PublishedTable, FitInput]:
    """The published table and the fit's input made of it."""
    table = _table()
    return table, fit_input(table, _table_decode_us(table))


def calibrated_cost() -> tuple[PublishedTable, CostModel]:
    """The published table and the terms fitted to it (``bidir_kv.plan.calibrate.fit``)."""
    table, inp = calibrated_input()
    return table, fit(inp)


def _decode_us(shape: ModelShape, hw: Hardware, weight_bytes_per_param: float) -> float:
    """One decode step, batch 1: the active weights streamed once from HBM, two TP
    all-reduces per layer (assumptions)."""
    weights_bytes = shape.active_params * weight_bytes_per_param / hw.gpus
    decode_us = weights_bytes / (hw.hbm_gbytes_per_s * 1e9 * HBM_EFFICIENCY) * 1e6
    return decode_us + shape.num_layers * 2 * ALLREDUCE_US


def _emulator_fields(decode_us_per_seq: float, sources: Sequence[str]) -> dict[str, Any]:
    return {
        "decode_us_per_seq": decode_us_per_seq,
        "max_num_batched_tokens": 8192,
        "kv_bytes_per_token": 256,
        "num_layers": 4,
        "time_scale": 1.0,
        "sources": list(sources),
    }


def calibrated_profile() -> dict[str, Any]:
    """``qwen3-32b-p5en``: every timing term from the fit to the published table."""
    table, cost = calibrated_cost()
    target = _ALL_TARGETS["qwen3-32b-p5en-derived"]
    shape = target_shape(target.config)
    tp = table.tp_size
    rank_bytes = shape.kv_bytes_per_token_per_rank(tp)
    rail = rank_bytes / (cost.xfer_us_per_token * 1e3)
    err = {(r.point, r.figure): r.error for r in residuals(calibrated_input()[1], cost)}

    def res(*figures: str) -> str:
        return ", ".join(
            f"{fig} {pt}: {e:+.1%}" for (pt, fig), e in sorted(err.items()) if fig in figures
        )

    fit_src = f"published fit ({table.name}, bidir_kv/data/published; docs/profiles.md §2)"
    sources = (
        f"prefill {cost.recompute_us_per_token:.3f} µs/token + {cost.prefill_fixed_us / 1e3:.2f}"
        f" ms per request: {fit_src}, OFF prefill; residuals {res('prefill OFF')}",
        f"attention {cost.recompute_us_per_token_ctx:.4f} µs/token per 1k context: the matmul "
        "term x the FLOP ratio of bidir_kv/data/model_configs/qwen3-32b.json (assumption: "
        "attention runs at the matmuls' rate)",
        f"pull {cost.pull_overhead_us / 1e3:.2f} ms fixed + {cost.xfer_us_per_token:.3f} µs/token"
        f" ({rail:.2f} GB/s per rank at {rank_bytes:,.0f} B per rank per token): {fit_src}, KV "
        f"transfer; the per-descriptor cost is folded into the bytes (two points, one "
        f"descriptor size); residuals {res('KV transfer')}",
        f"P's work per pulled token {cost.pull_after_us_per_token:.3f} µs (descriptor "
        f"preparation, block bookkeeping, the step that sees the READ complete) and step "
        f"{cost.step_us:.0f} µs: {fit_src}, ON prefill less the rest; residuals "
        f"{res('prefill ON')}",
        f"D's part of TTFT {cost.decode_ttft_fixed_us / 1e3:.2f} ms + "
        f"{cost.decode_ttft_us_per_token:.3f} µs per prompt token: {fit_src}, TTFT less the "
        f"prefill, both legs; residuals {res('TTFT OFF', 'TTFT ON')}",
        "workload behind the figures (prompt and pulled tokens per point): assumptions in "
        "bidir_kv/plan/published.py",
        "descriptors: 64 layers x 2 (K, V) per 16-token block per rank (counted, no cost of "
        "their own: folded into the bytes)",
        "handshake 6 s on the first pull of a pair: llm-d's GLM-5.2 H200 results",
        "decode: active weights / GPUs / (4.8 TB/s x 0.7) + 2 all-reduces x 10 µs per layer: "
        "assumptions (the table has no decode figure)",
    )
    return {
        "name": CALIBRATED,
        "description": "Qwen3-32B bf16, TP 8 on p5en.48xlarge (8x H200), D->P NIXL READs over "
        "EFA (the AWS blog's 1P1D), calibrated on the published figures",
        **_cost_fields(cost, shape, tp, table.block_size, rail),
        "decode_us_per_step": round(_decode_us(shape, target.hardware, 2.0), 1),
        **_emulator_fields(target.decode_us_per_seq, sources),
        "derivation": "generated by bidir_kv.plan.derive (python -m bidir_kv.plan.derive "
        "--write): the published table fitted by bidir_kv.plan.calibrate.fit; docs/profiles.md",
    }


def _cost_fields(
    cost: CostModel, shape: ModelShape, tp: int, block_size: int, rail: float
) -> dict[str, Any]:
    return {
        "prefill_us_per_token": round(cost.recompute_us_per_token, 4),
        "prefill_us_per_token_ctx": round(cost.recompute_us_per_token_ctx, 5),
        "prefill_fixed_us": round(cost.prefill_fixed_us, 1),
        "kv_bytes_per_token_target": round(shape.kv_bytes_per_token(tp)),
        "transfer_overhead_us": round(cost.pull_overhead_us, 1),
        "transfer_gbytes_per_s": round(rail * tp, 4),
        "transfer_per_descriptor_us": round(cost.xfer_us_per_descriptor, 4),
        "rail_gbytes_per_s": round(rail, 5),
        "rails_per_rank": 1,
        "tp_size": tp,
        "target_block_size": block_size,
        "descriptors_per_block": shape.num_layers * shape.kv_tensors_per_layer(),
        "step_us": round(cost.step_us, 1),
        "handshake_us": 6e6,
        "pull_after_us_per_token": round(cost.pull_after_us_per_token, 4),
        "decode_ttft_fixed_us": round(cost.decode_ttft_fixed_us, 1),
        "decode_ttft_us_per_token": round(cost.decode_ttft_us_per_token, 4),
    }


# ---- predicted: another model, its compute from its class ---------------------------

GLM_CLASS = "moe-mla-dsa"  # MoE + MLA + DeepSeek sparse attention, FP8 (sources.py)
# LMCache PR #4161: NIXL/UCX READs on one rail, 256 descriptors of 4 KiB at 4.69 GB/s and
# of 256 KiB at 12.2 GB/s. Two sizes give a cost per descriptor and a per-byte rate:
# 4,096 / 4.69 = tau + 4,096 / R and 262,144 / 12.2 = tau + 262,144 / R (GB/s = B/ns)
_SMALL, _SMALL_GBPS, _LARGE, _LARGE_GBPS = 4096, 4.69, 262_144, 12.2
# p5en: 16 x 200 Gb/s EFA for 8 GPUs, two rails per GPU (AWS p5en instance type); NIXL's
# LIBFABRIC backend registers each GPU's KV on the two rails behind its PCIe switch
# (docs/protocol.md §13.5)
P5EN_LINE_GBPS_PER_GPU = 2 * 25.0


def descriptor_split() -> tuple[float, float]:
    """(µs per descriptor, GB/s) of one rail from LMCache PR #4161's two sizes."""
    rate = (_LARGE - _SMALL) / (_LARGE / _LARGE_GBPS - _SMALL / _SMALL_GBPS)  # B/ns = GB/s
    tau_us = (_SMALL / _SMALL_GBPS - _SMALL / rate) / 1e3
    return tau_us, rate


@dataclass(frozen=True)
class Prediction:
    """GLM-5-FP8's terms and where each comes from (docs/profiles.md §4)."""

    cost: CostModel
    rate: ClassRate
    per_descriptor_us: float
    rail_gbytes_per_s: float
    pull_scale: float  # the LMCache split scaled to reproduce the calibrated Qwen pull
    sources: tuple[str, ...]


def predicted_cost() -> Prediction:
    """GLM-5-FP8 on p5en: compute from its class's public measurements, KV bytes and
    descriptors as vLLM serves them, the deployment terms from the Qwen3-32B fit; each
    uncertain term with its range."""
    table, qwen = calibrated_cost()
    qshape = target_shape(_ALL_TARGETS["qwen3-32b-p5en-derived"].config)
    shape = target_shape(GLM.config)  # kv_cache_dtype auto: the model's bf16
    tp = table.tp_size
    hw = GLM.hardware
    block = shape.served_block_size(hw.block_size)
    rate = class_rate(GLM_CLASS)
    node_flops = hw.gpus * FP8_PEAK_TFLOPS * 1e12
    recompute = shape.linear_flops_per_token() / (node_flops * rate.center) * 1e6
    ctx = shape.context_flops_per_token() * 1000 / (node_flops * rate.center) * 1e6
    r_low, r_high = rate.factors()

    # the pull: the per-descriptor / per-byte split of one rail, scaled so that it gives
    # the Qwen3-32B fit's per-token pull back (8 descriptors of 4 KiB per token per rank)
    tau, line = descriptor_split()
    q_desc = qshape.num_layers * qshape.kv_tensors_per_layer() / table.block_size
    q_bytes = qshape.kv_bytes_per_token_per_rank(tp)
    scale = qwen.xfer_us_per_token / (q_desc * tau + q_bytes / (line * 1e3))
    per_desc, rail = tau * scale, line / scale
    g_desc = shape.num_layers * shape.kv_tensors_per_layer() / block
    g_bytes = shape.kv_bytes_per_token_per_rank(tp)
    pull = g_desc * per_desc + g_bytes / (rail * 1e3)
    # the two readings of the Qwen fit: all of it per descriptor (bytes at the line rate)
    # or all of it per byte (descriptors free)
    pull_low = qwen.xfer_us_per_token / q_desc * g_desc + g_bytes / (P5EN_LINE_GBPS_PER_GPU * 1e3)
    pull_high = g_bytes * qwen.xfer_us_per_token / q_bytes
    desc_ratio, byte_ratio = g_desc / q_desc, g_bytes / q_bytes
    fixed_high_us = 0.0  # set below, once the center's recompute is known
    cost = CostModel(
        recompute_us_per_token=recompute,
        recompute_us_per_token_ctx=ctx,
        xfer_us_per_token=g_bytes / (rail * 1e3),
        pull_overhead_us=qwen.pull_overhead_us,
        kv_bytes_per_token=shape.kv_bytes_per_token(tp),
        source="prediction",
        xfer_us_per_descriptor=per_desc,
        descriptors_per_token=g_desc,
        step_us=qwen.step_us,
        prefill_fixed_us=qwen.prefill_fixed_us * shape.num_layers / qshape.num_layers,
        pull_after_us_per_token=qwen.pull_after_us_per_token,
        decode_ttft_fixed_us=qwen.decode_ttft_fixed_us,
        decode_ttft_us_per_token=qwen.decode_ttft_us_per_token,
        block_size=block,
    )
    fixed_high_us = GLM_FIXED.ttft_ms * 1e3 - cost.recompute_us(GLM_FIXED.prompt_tokens)
    spread_of = ", ".join(rate.spread_sources)
    uncertainty = (
        TermRange(
            "recompute",
            round(r_low, 4),
            round(r_high, 4),
            f"the class's spread over {spread_of}: {rate.high:.2%} to {rate.low:.2%} of the FP8 "
            f"peak around {rate.center:.2%}",
        ),
        TermRange(
            "pull",
            round(pull_low / pull, 4),
            round(pull_high / pull, 4),
            f"the Qwen3-32B fit read as all per descriptor ({pull_low:.2f} µs/token, bytes at "
            f"the {P5EN_LINE_GBPS_PER_GPU:g} GB/s line rate) or all per byte "
            f"({pull_high:.2f} µs/token)",
        ),
        TermRange(
            "pull_after",
            round(desc_ratio, 4),
            round(byte_ratio, 4),
            f"P's work per pulled token if it scales per descriptor (x {desc_ratio:.3f}) or "
            f"per byte (x {byte_ratio:.3f}) rather than per token",
        ),
        TermRange(
            "prefill_fixed",
            round(qshape.num_layers / shape.num_layers, 4),
            round(max(1.0, fixed_high_us / cost.prefill_fixed_us), 4),
            f"Qwen3-32B's fitted {qwen.prefill_fixed_us / 1e3:.1f} ms as a deployment cost, "
            f"or the SGLang GLM-5 single-request TTFT at 1K less its tokens "
            f"({fixed_high_us / 1e3:.0f} ms)",
        ),
        TermRange(
            "decode_part",
            1.0,
            round(byte_ratio, 4),
            f"D's part carried per prompt token, or per byte (x {byte_ratio:.3f})",
        ),
    )
    from_cal = f"from {CALIBRATED} (its published fit)"
    sources = (
        *GLM.sources,
        f"prefill {recompute:.2f} µs/token + {ctx:.4f} per 1k context: the config's FLOPs "
        f"({shape.linear_flops_per_token() / 1e9:.1f} G per token: 2 x "
        f"{shape.active_params / 1e9:.1f}B active + sparse attention over {shape.index_topk} "
        f"tokens in the latent; the indexer's {shape.context_flops_per_token() / 1e6:.2f} M "
        f"per context token) at {rate.center:.2%} of the FP8 peak: the median of the public "
        f"{GLM_CLASS} prefill measurements on H200 ({', '.join(rate.sources)}; "
        "bidir_kv/plan/sources.py, docs/profiles.md §8); range x"
        f"{r_low:.2f}-x{r_high:.2f}",
        f"{cost.prefill_fixed_us / 1e3:.1f} ms per request: {from_cal}, "
        f"{qwen.prefill_fixed_us / 1e3:.1f} ms x {shape.num_layers} / {qshape.num_layers} "
        "layers (assumption: the per-request part is per layer: collectives at TP 8)",
        f"KV {g_bytes:,.0f} B per token per rank: {shape.kv_cache_dtype} latent "
        f"{shape.latent_bytes_per_token_layer():.0f} B + indexer keys "
        f"{shape.indexer_bytes_per_token_layer():.0f} B per layer x {shape.num_layers} "
        "(vLLM 0.29: kv_cache_dtype auto is the model dtype; the latent is replicated on "
        "every TP rank and each P rank reads its peer's copy)",
        f"pull {cost.pull_overhead_us / 1e3:.2f} ms fixed {from_cal} + {g_desc:.4f} "
        f"descriptors/token x {per_desc:.3f} µs + bytes at {rail:.2f} GB/s per rank = "
        f"{pull:.2f} µs/token: LMCache PR #4161's per-descriptor ({tau:.3f} µs) and per-byte "
        f"({line:.2f} GB/s) split, scaled x{scale:.3f} to give the fitted Qwen3-32B pull "
        f"({qwen.xfer_us_per_token:.3f} µs/token) back",
        f"P's work per pulled token {qwen.pull_after_us_per_token:.3f} µs: {from_cal} "
        "(assumption: per token)",
        f"D's part of TTFT {cost.decode_ttft_fixed_us / 1e3:.2f} ms + "
        f"{cost.decode_ttft_us_per_token:.3f} µs per prompt token: {from_cal} (assumption)",
    )
    cost = replace(cost, uncertainty=uncertainty, sources=sources)
    return Prediction(cost, rate, per_desc, rail, scale, sources)


def predicted_profile() -> dict[str, Any]:
    """``glm5-fp8-p5en``: GLM-5-FP8 predicted from its class, fitted to no GLM-5 figure."""
    pred = predicted_cost()
    cost = pred.cost
    shape = target_shape(GLM.config)
    tp = GLM.hardware.gpus
    return {
        "name": PREDICTED,
        "description": GLM.description,
        **_cost_fields(cost, shape, tp, cost.block_size, pred.rail_gbytes_per_s),
        "decode_us_per_step": round(_decode_us(shape, GLM.hardware, 1.0), 1),
        **_emulator_fields(GLM.decode_us_per_seq, pred.sources),
        "uncertainty": [asdict(t) for t in cost.uncertainty],
        "derivation": "generated by bidir_kv.plan.derive (python -m bidir_kv.plan.derive "
        "--write): compute from the public measurements of its class, KV as vLLM serves "
        f"it, the deployment terms from {CALIBRATED}; fitted to no GLM-5 figure; "
        "docs/profiles.md §4",
    }


def generated_profiles() -> dict[str, dict[str, Any]]:
    """Every generated profile by name: derived, calibrated, predicted."""
    out = {name: derive_profile(t) for name, t in TARGETS.items()}
    out[CALIBRATED] = calibrated_profile()
    out[PREDICTED] = predicted_profile()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bidir_kv.plan.derive")
    ap.add_argument(
        "--write", action="store_true", help="rewrite bidir_kv/data/profiles/*-p5en*.json"
    )
    args = ap.parse_args(argv)
    for name, data in generated_profiles().items():
        text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
        if args.write:
            with as_file(PROFILE_DIR / f"{name}.json") as path:
                Path(path).write_text(text)
        else:
            print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
