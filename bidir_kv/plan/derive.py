"""Emulator profiles derived from a model shape and target figures, with their sources.

``bidir_kv/data/profiles/<name>-p5en.json`` are *outputs* of this module, never edited
by hand: ``python -m bidir_kv.plan.derive --write`` regenerates them (in the checkout)
from the model configs in ``bidir_kv/data/model_configs/``, and
``suites/unit/test_bench_plan.py::test_profiles_match_the_planner_derivation`` fails
when a file and the derivation drift apart. The planner (``CostModel.from_hardware``)
and the emulator (``CostProfile.pull_model``) evaluate the same terms, so the
planner's prediction and the emulator agree by construction. Each term's citation
or assumption: docs/profiles.md.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

from bidir_kv.engine.profiles import PROFILE_DIR
from bidir_kv.plan.modelcfg import ModelShape, load_model_config, model_shape
from bidir_kv.plan.planner import CostModel, Hardware

__all__ = ["TARGETS", "Target", "derive_profile", "profile_fields", "target_shape"]

# package data beside the profiles (pyproject.toml [tool.setuptools.package-data])
CONFIG_DIR = files("bidir_kv") / "data" / "model_configs"
ALLREDUCE_US = 10.0  # one small tensor-parallel all-reduce inside a node (NVLink), assumption
HBM_EFFICIENCY = 0.7  # achieved fraction of HBM bandwidth when streaming weights, assumption
# llm-d's GLM-5.2 on H200: recompute ~130-144 µs/token; the low end is the short-context rate
GLM_MEASURED_PREFILL_US = 130.0

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
    return model_shape(load_model_config(CONFIG_DIR / f"{config}.json"))


def _glm_hardware() -> Hardware:
    """FP8 peak, and the MFU that reproduces llm-d's measured short-context recompute."""
    base = Hardware(peak_tflops_per_gpu=1979.0, block_size=64)
    flops = target_shape("glm-5-fp8").linear_flops_per_token()
    mfu = flops / (GLM_MEASURED_PREFILL_US * 1e-6 * base.gpus * base.peak_tflops_per_gpu * 1e12)
    return replace(base, mfu=round(mfu, 5))


def _targets() -> dict[str, Target]:
    qwen = Target(
        profile="qwen3-32b-p5en",
        config="qwen3-32b",
        description="Qwen3-32B bf16, TP 8 on p5en.48xlarge (8x H200), D->P NIXL READs over "
        "EFA (the AWS blog's 1P1D)",
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
        "p5en.48xlarge, D->P NIXL READs over EFA",
        hardware=_glm_hardware(),
        weight_bytes_per_param=1.0,
        decode_us_per_seq=100.0,
        sources=(
            "shape: bidir_kv/data/model_configs/glm-5-fp8.json (MLA latent 512 + rope 64, "
            "indexer keys 128 FP8, 78 layers; checked against the model card's 744B / 40B)",
            "H200 dense FP8 1979 TFLOP/s: NVIDIA H200 datasheet",
            "prefill 130 µs/token at short context (MFU derived from it): llm-d's GLM-5.2 H200 "
            "results, recompute ~130-144 µs/token; assumption: GLM-5.2 costs what GLM-5 does",
            "block size 64: assumption (vLLM's FlashMLA and sparse-MLA backends on Hopper)",
            "descriptors: 78 layers x 2 (latent, indexer keys) per 64-token block per rank; the "
            "latent is replicated on every rank",
            *_NET,
        ),
    )
    return {t.profile: t for t in (qwen, glm)}


TARGETS: dict[str, Target] = _targets()


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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bidir_kv.plan.derive")
    ap.add_argument(
        "--write", action="store_true", help="rewrite bidir_kv/data/profiles/*-p5en.json"
    )
    args = ap.parse_args(argv)
    for target in TARGETS.values():
        text = json.dumps(derive_profile(target), indent=2, ensure_ascii=False) + "\n"
        if args.write:
            with as_file(PROFILE_DIR / f"{target.profile}.json") as path:
                Path(path).write_text(text)
        else:
            print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
