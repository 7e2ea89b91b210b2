"""A calibration written as an emulator profile: emulate the cluster a ``bench`` run measured.

``bidir-kv bench … --write-profile FILE`` and ``bidir-kv calibrate`` (or
``write_profile``) turn the fitted terms into ``CostProfile`` fields that
``bidir-kv plan --profile FILE`` and ``bidir-kv engine --profile FILE`` load. The fit is
per rank-level transfer, so the profile has ``tp_size`` 1 and the run's measured bytes
per token. Every fitted term is in it — the per-request part, P's work per pulled
token, D's part of TTFT — so ``plan --profile FILE`` predicts the deployment that was
measured; an emulator running the profile adds its own small per-request work on top
(``bench`` reports it as overhead, docs/profiles.md §7).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from bidir_kv.bench.results import ResultDir, load_result
from bidir_kv.engine.profiles import CostProfile, load_profile
from bidir_kv.plan.calibrate import calibrate
from bidir_kv.plan.planner import DEFAULT_BLOCK_SIZE, CostModel

__all__ = ["calibrated_profile", "write_profile"]

_EMULATED_BYTES_PER_TOKEN = 256  # what the emulator really moves (docs/profiles.md §7)
_EMULATED_LAYERS = 4


def _decode_us(result: ResultDir) -> float:
    tpots = [r.tpot_ms for recs, _ in result.points.values() for r in recs if r.ok and r.tpot_ms]
    return statistics.median(tpots) * 1e3 if tpots else 0.0


def calibrated_profile(result: ResultDir, cost: CostModel, name: str) -> dict[str, Any]:
    """The JSON object of a profile holding ``cost`` (a calibration of ``result``)."""
    engines = result.manifest.get("engines") or {}
    block = int(engines.get("block_size") or DEFAULT_BLOCK_SIZE)
    bpt = cost.kv_bytes_per_token
    rank_gbps = bpt / (cost.xfer_us_per_token * 1e3) if cost.xfer_us_per_token > 0 else 0.0
    per_block = round(cost.descriptors_per_token * block) if cost.xfer_us_per_descriptor else 0
    data: dict[str, Any] = {
        "name": name,
        "description": f"calibrated from the bench run {result.path} "
        f"({result.manifest.get('topology', '?')}, model {result.manifest.get('model', '?')})",
        "prefill_us_per_token": round(cost.recompute_us_per_token, 4),
        "prefill_us_per_token_ctx": round(cost.recompute_us_per_token_ctx, 5),
        "decode_us_per_step": round(_decode_us(result), 1),
        "kv_bytes_per_token_target": max(1, round(bpt)),
        "kv_bytes_per_token": _EMULATED_BYTES_PER_TOKEN,
        "num_layers": _EMULATED_LAYERS,
        "transfer_overhead_us": round(cost.pull_overhead_us, 2),
        "transfer_gbytes_per_s": round(rank_gbps, 6),
        "transfer_per_descriptor_us": round(cost.xfer_us_per_descriptor, 5),
        "rail_gbytes_per_s": round(rank_gbps, 6),
        "rails_per_rank": 1,
        "tp_size": 1,
        "target_block_size": block,
        "descriptors_per_block": per_block,
        "step_us": round(cost.step_us, 1),
        "prefill_fixed_us": round(cost.prefill_fixed_us, 1),
        "pull_after_us_per_token": round(cost.pull_after_us_per_token, 4),
        "decode_ttft_fixed_us": round(cost.decode_ttft_fixed_us, 1),
        "decode_ttft_us_per_token": round(cost.decode_ttft_us_per_token, 4),
        "sources": list(cost.notes),
    }
    CostProfile(**{**data, "sources": tuple(data["sources"])})  # validates before writing
    return data


def write_profile(result_dir: Path, path: Path, name: str | None = None) -> CostProfile:
    """Calibrate ``result_dir``, write the profile to ``path``, return it as loaded."""
    result = load_result(result_dir)
    data = calibrated_profile(result, calibrate(result), name or path.stem)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return load_profile(str(path))
