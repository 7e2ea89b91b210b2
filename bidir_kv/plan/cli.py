"""``bidir-kv plan``: break-even threshold, TTFT saving per prompt length, TTL memory.

The cost model comes from a Hugging Face ``config.json`` plus hardware figures
(defaults: p5en.48xlarge), from a ``bench`` result (``--calibration DIR``), or
from explicit per-token figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bidir_kv.bench.args import distribution, float_list, int_list
from bidir_kv.bench.distributions import Distribution, DistributionError
from bidir_kv.bench.results import ResultError, load_result
from bidir_kv.engine.profiles import ProfileError, TermRange, load_profile
from bidir_kv.plan.calibrate import CheckRow, calibrate, check_rows
from bidir_kv.plan.decode import (
    DEFAULT_HBM_GBYTES_PER_S,
    DecodeSide,
    decode_step_ms,
    pull_hbm_ms,
    retention_room,
)
from bidir_kv.plan.modelcfg import ModelConfigError, load_model_config, model_shape
from bidir_kv.plan.planner import (
    DEFAULT_BLOCK_SIZE,
    CostModel,
    Hardware,
    PlanError,
    Workload,
    break_even_tokens,
    recommend_threshold,
    recommend_ttl,
    ttft_rows,
    ttl_rows,
)
from bidir_kv.plan.predict import cost_from_profile
from bidir_kv.plan.ranges import break_even_spread, threshold_check, ttft_spreads
from bidir_kv.plan.sources import FP8_PEAK_TFLOPS, class_rate, model_class
from bidir_kv.plan.tail import Tail, tail_text

__all__ = ["build_parser", "main", "run_plan"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bidir-kv plan",
        description="Plan kv_recompute_threshold and decoder_kv_blocks_ttl for a model/network.",
    )
    _cost_source_args(ap)
    _hardware_args(ap)
    _workload_args(ap)
    _decode_args(ap)
    ap.add_argument(
        "--check",
        type=Path,
        metavar="DIR",
        help="a bench result to hold the cost model against, point by point (e.g. a fresh "
        "run at lengths a calibration did not use)",
    )
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def _cost_source_args(ap: argparse.ArgumentParser) -> None:
    src = ap.add_argument_group("cost model (one of)")
    src.add_argument("--config", type=Path, help="Hugging Face config.json of the model")
    src.add_argument("--profile", help="an emulator profile (a shipped name or a JSON path)")
    src.add_argument("--calibration", type=Path, metavar="DIR", help="a bench result directory")
    src.add_argument("--recompute-us-per-token", type=float, help="explicit recompute cost")
    src.add_argument("--xfer-us-per-token", type=float, help="explicit pull cost per token")
    src.add_argument("--kv-bytes-per-token", type=float, help="KV bytes per token (whole TP group)")


def _hardware_args(ap: argparse.ArgumentParser) -> None:
    hw = Hardware()
    h = ap.add_argument_group("hardware (with --config; defaults: p5en, docs/profiles.md)")
    h.add_argument("--tp", type=int, default=hw.gpus, help="tensor-parallel size (default 8)")
    h.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="per-GPU dense peak (default 989, H200 BF16; 1979, FP8, for a model of a measured "
        "class)",
    )
    h.add_argument(
        "--mfu",
        type=float,
        default=None,
        help=f"achieved fraction of the peak in prefill (default: the model class's share of "
        f"the FP8 peak from public measurements, with their spread as a range, "
        f"docs/profiles.md §8; a model of no measured class: {hw.mfu:g}, an assumption)",
    )
    h.add_argument(
        "--rail-gbps",
        type=float,
        default=hw.rail_gbytes_per_s,
        help="achieved GB/s of one rank-level transfer per rail (default: measured 4.4)",
    )
    h.add_argument("--rails-per-gpu", type=int, default=hw.rails_per_gpu)
    h.add_argument("--per-descriptor-us", type=float, default=hw.per_descriptor_us)
    h.add_argument(
        "--target-block-size",
        type=int,
        default=None,
        help="the target's KV block (default: what vLLM picks for the model: 64 for "
        "sparse MLA on Hopper, else 16)",
    )
    h.add_argument("--step-us", type=float, default=hw.step_us, help="one idle engine step")
    h.add_argument(
        "--pull-overhead-us",
        type=float,
        default=None,
        help=f"fixed cost per pull (default {hw.pull_overhead_us:g}; "
        "with --calibration or --profile: theirs)",
    )
    h.add_argument(
        "--kv-cache-dtype",
        "--kv-dtype",
        dest="kv_dtype",
        default=None,
        help="vLLM's --kv-cache-dtype (default auto: the model's dtype; fp8 for a sparse-MLA "
        "model is vLLM's fp8_ds_mla layout)",
    )


def _workload_args(ap: argparse.ArgumentParser) -> None:
    w = ap.add_argument_group("workload")
    w.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"KV block size for the threshold and the pulls (default: the cost source's, "
        f"else {DEFAULT_BLOCK_SIZE})",
    )
    w.add_argument(
        "--prompt-lengths", type=int_list, default=[2000, 4000, 8000, 12000, 16000, 20000, 24000]
    )
    w.add_argument("--new-tokens", type=int, default=150, help="new tokens per turn P computes")
    w.add_argument(
        "--fixed-ms",
        type=float,
        default=0.0,
        help="TTFT part common to both legs (D's tail read, first decode step)",
    )
    w.add_argument(
        "--threshold",
        type=int,
        default=None,
        help="evaluate this kv_recompute_threshold (default: the recommended one)",
    )
    w.add_argument(
        "--conversation-rate",
        type=float,
        default=0.1,
        help="new conversations per second per D instance",
    )
    w.add_argument("--turns", type=int, default=10)
    w.add_argument("--first-prompt-tokens", type=int, default=2150)
    w.add_argument("--output-tokens", type=int, default=300)
    w.add_argument(
        "--tokens-per-turn",
        type=int,
        default=450,
        help="tokens a turn adds to the history (input + output)",
    )
    w.add_argument(
        "--turn-gap",
        type=distribution,
        default=Distribution("exp", (60.0,)),
        help="gap between turns: const:S, uniform:A,B, exp:MEAN, lognormal:MEDIAN,SIGMA",
    )
    w.add_argument("--ttls", type=float_list, default=[30, 60, 120, 240, 480, 960, 1800])
    w.add_argument(
        "--miss-target",
        type=float,
        default=0.05,
        help="acceptable fraction of follow-up turns that find D's blocks expired",
    )
    w.add_argument(
        "--kv-budget-gib",
        type=float,
        default=None,
        help="KV memory one D instance may spend on retained blocks",
    )


def _cost_model(args: argparse.Namespace) -> CostModel:
    chosen = [
        args.config is not None,
        args.calibration is not None,
        args.profile is not None,
        args.recompute_us_per_token is not None,
    ]
    if sum(chosen) != 1:
        raise PlanError(
            "give exactly one cost source: --config, --calibration, --profile or "
            "--recompute-us-per-token"
        )
    if args.config is not None:
        shape = model_shape(load_model_config(args.config), args.kv_dtype)
        cls = model_class(shape) if args.mfu is None else None
        rate = class_rate(cls) if cls else None
        default_hw = Hardware()
        hw = Hardware(
            gpus=args.tp,
            peak_tflops_per_gpu=args.peak_tflops
            or (FP8_PEAK_TFLOPS if rate else default_hw.peak_tflops_per_gpu),
            mfu=args.mfu or (rate.center if rate else default_hw.mfu),
            rail_gbytes_per_s=args.rail_gbps,
            rails_per_gpu=args.rails_per_gpu,
            per_descriptor_us=args.per_descriptor_us,
            block_size=args.target_block_size or shape.served_block_size(DEFAULT_BLOCK_SIZE),
            step_us=args.step_us,
            pull_overhead_us=(
                args.pull_overhead_us
                if args.pull_overhead_us is not None
                else Hardware().pull_overhead_us
            ),
        )
        cost = CostModel.from_hardware(shape, hw)
        if rate is None:
            return cost
        low, high = rate.factors()
        where = f"{cls}: median of {', '.join(rate.sources)} (docs/profiles.md §8)"
        return replace(
            cost,
            notes=(*cost.notes, f"compute: {rate.center:.2%} of the FP8 peak, class {where}"),
            uncertainty=(
                TermRange(
                    "recompute",
                    round(low, 4),
                    round(high, 4),
                    f"the class's spread over {', '.join(rate.spread_sources)}",
                ),
            ),
        )
    if args.calibration is not None or args.profile is not None:
        cost = _measured_or_profile(args)
        if args.pull_overhead_us is not None:
            cost = replace(cost, pull_overhead_us=args.pull_overhead_us)
        return cost
    if args.xfer_us_per_token is None or args.kv_bytes_per_token is None:
        raise PlanError(
            "--recompute-us-per-token needs --xfer-us-per-token and --kv-bytes-per-token"
        )
    return CostModel(
        recompute_us_per_token=args.recompute_us_per_token,
        recompute_us_per_token_ctx=0.0,
        xfer_us_per_token=args.xfer_us_per_token,
        pull_overhead_us=(
            args.pull_overhead_us
            if args.pull_overhead_us is not None
            else Hardware().pull_overhead_us
        ),
        kv_bytes_per_token=args.kv_bytes_per_token,
        source="explicit",
    )


def _measured_or_profile(args: argparse.Namespace) -> CostModel:
    if args.calibration is not None:
        return calibrate(load_result(args.calibration), args.kv_bytes_per_token)
    cost = cost_from_profile(args.profile)
    if cost is None:
        raise PlanError(f"profile {args.profile!r} has no compute costs (or does not load)")
    return cost


def _decode_args(ap: argparse.ArgumentParser) -> None:
    d = ap.add_argument_group(
        "decode side (what retention costs D; bidir_kv/plan/decode.py, docs/benchmarking.md)"
    )
    d.add_argument(
        "--d-kv-gib",
        type=float,
        default=None,
        help="D's KV pool for one instance (whole TP group), GiB: with it the TTL advice "
        "keeps retained turns beside the running batch and names a retention budget",
    )
    d.add_argument(
        "--decode-concurrency",
        type=int,
        default=2,
        help="requests decoding on D at once (default 2: the publication's two clients)",
    )
    d.add_argument(
        "--hbm-gbytes-per-s",
        type=float,
        default=DEFAULT_HBM_GBYTES_PER_S,
        help=f"memory bandwidth of one D rank (default {DEFAULT_HBM_GBYTES_PER_S:g}: H200)",
    )


def _decode_side(
    args: argparse.Namespace, cost: CostModel, work: Workload, ttl: list[Any]
) -> tuple[dict[str, Any] | None, float | None]:
    """The decode-side terms as the plan prints them, and the GiB retention may take
    (None: D's pool not given)."""
    if getattr(args, "d_kv_gib", None) is None:
        return None, None
    side = DecodeSide(
        args.d_kv_gib,
        args.decode_concurrency,
        ranks=args.tp,
        hbm_gbytes_per_s=args.hbm_gbytes_per_s,
    )
    room = retention_room(cost, work, side, ttl)
    longest = max(args.prompt_lengths)
    out: dict[str, Any] = {
        "pool_gib": room.pool_gib,
        "concurrency": side.concurrency,
        "running_gib": room.running_gib,
        "room_gib": room.room_gib,
        "budget_share": room.budget_share,
        "overflows": {str(k): v for k, v in room.overflows.items()},
        "share_of_pool": {str(k): v for k, v in room.share_of_pool.items()},
        "pull_tokens": longest,
        "pull_hbm_ms": pull_hbm_ms(cost, longest, side),
        "decode_step_ms": None,
        "room": room,
    }
    if args.profile is not None:
        with contextlib.suppress(ProfileError):  # the cost source already said what is wrong
            out["decode_step_ms"] = decode_step_ms(load_profile(args.profile), side.concurrency)
    return out, room.room_gib


def run_plan(args: argparse.Namespace) -> dict[str, Any]:
    cost = _cost_model(args)
    block = args.block_size or cost.block_size or DEFAULT_BLOCK_SIZE
    threshold, t_why = recommend_threshold(cost, block)
    used = args.threshold if args.threshold is not None else (threshold or 2**31 - 1)
    ttft = ttft_rows(
        cost,
        args.prompt_lengths,
        args.new_tokens,
        used,
        args.fixed_ms * 1e3,
        block_size=block,
    )
    work = Workload(
        conversations_per_s=args.conversation_rate,
        turns=args.turns,
        first_prompt_tokens=args.first_prompt_tokens,
        tokens_per_turn=args.tokens_per_turn,
        output_tokens=args.output_tokens,
        gap=args.turn_gap,
    )
    ttl = ttl_rows(cost, work, args.ttls, gpus=args.tp)
    decode, room_gib = _decode_side(args, cost, work, ttl)
    budget = args.kv_budget_gib
    if room_gib is not None:  # retention must leave D's running batch its room
        budget = room_gib if budget is None else min(budget, room_gib)
    best, ttl_why = recommend_ttl(ttl, args.miss_target, budget)
    if decode is not None:
        ttl_why += ". Decode side: " + decode.pop("room").recommend(best)
    check = []
    checked = args.check if args.check is not None else args.calibration
    if checked is not None:
        check = [asdict(r) for r in check_rows(load_result(checked), cost)]
    return {
        "calibration_check": check,
        "checked_run": str(args.check) if args.check is not None else None,
        "cost_model": cost.to_dict(),
        "block_size": block,
        "break_even_tokens": break_even_tokens(cost),
        "recommended_threshold": threshold,
        "threshold_reason": t_why,
        "evaluated_threshold": used,
        "ranges": _ranges(cost, args, threshold, used, block),
        "ttft": [r.__dict__ for r in ttft],
        "ttl": [r.__dict__ for r in ttl],
        "recommended_ttl_s": best.ttl_s,
        "decode_side": decode,
        "ttl_reason": ttl_why,
        "workload": {
            "conversations_per_s": work.conversations_per_s,
            "turns": work.turns,
            "turn_gap": str(work.gap),
            "mean_gap_s": work.gap.mean(),
        },
    }


def _ranges(
    cost: CostModel, args: argparse.Namespace, threshold: int | None, used: int, block: int
) -> dict[str, Any] | None:
    """The answers over the cost model's uncertainty (bidir_kv.plan.ranges); None: a point."""
    if not cost.uncertainty:
        return None
    be = break_even_spread(cost)
    rows = ttft_spreads(
        cost, args.prompt_lengths, args.new_tokens, used, args.fixed_ms * 1e3, block_size=block
    )
    check = threshold_check(cost, threshold if args.threshold is None else args.threshold, block)
    return {
        "terms": [asdict(t) for t in cost.uncertainty],
        "break_even": asdict(be),
        "ttft": [
            {
                "prompt_tokens": r.prompt_tokens,
                "off_ms": [r.off_ms.low, r.off_ms.high],
                "on_ms": [r.on_ms.low, r.on_ms.high],
                "ratio": [r.ratio.low, r.ratio.high],
                "ratio_dominant": r.ratio.dominant,
            }
            for r in rows
        ],
        "threshold_holds": check.holds,
        "robust_threshold": check.robust_threshold,
        "threshold_check": check.text,
    }


def render_text(plan: dict[str, Any]) -> str:
    c = plan["cost_model"]
    lines = [f"Cost model ({c['source']}):"]
    lines += [f"  {n}" for n in c["notes"]]
    lines += [
        f"  recompute {c['recompute_us_per_token']:.3f} µs/token "
        f"(+{c['recompute_us_per_token_ctx']:.4f} µs/token per 1k context)"
        + (f" + {c['prefill_fixed_us']:.0f} µs per request" if c["prefill_fixed_us"] else ""),
        f"  pull {c['pull_overhead_us']:.0f} µs fixed + {c['step_us'] / 2:.0f} µs (half a step)"
        f" + {c['xfer_us_per_token']:.4f} µs/token of bytes + "
        f"{c['descriptors_per_token']:.3f} descriptors/token × "
        f"{c['xfer_us_per_descriptor']:.3f} µs"
        + (
            f" + {c['pull_after_us_per_token']:.3f} µs/token after the transfer"
            if c["pull_after_us_per_token"]
            else ""
        )
        + f"; KV {c['kv_bytes_per_token']:,.0f} B/token",
    ]
    if c.get("sources"):
        lines.append("  sources:")
        lines += [f"    - {src}" for src in c["sources"]]
    lines += [
        "",
        "Break-even kv_recompute_threshold:",
    ]
    be = plan["break_even_tokens"]
    lines.append(f"  break-even at {be:.1f} tokens" if math.isfinite(be) else "  never")
    rng = plan.get("ranges")
    if rng:
        b = rng["break_even"]
        lines.append(
            f"  range {_num(b['low'])}-{_num(b['high'])} tokens over the terms' ranges; "
            f"dominant term: {b['dominant']}"
        )
    lines.append(f"  recommended: {plan['recommended_threshold']}  — {plan['threshold_reason']}")
    if rng:
        lines.append(f"  across the ranges: {rng['threshold_check']}")
    lines += [
        "",
        f"TTFT with P's prefix cache off (threshold {plan['evaluated_threshold']}):",
        f"  {'prompt':>7} {'history':>8} {'OFF ms':>9} {'ON ms':>9} {'saving ms':>10} "
        f"{'OFF/ON':>7}",
    ]
    for r in plan["ttft"]:
        lines.append(
            f"  {r['prompt_tokens']:>7} {r['history_tokens']:>8} {r['off_ms']:>9.1f} "
            f"{r['on_ms']:>9.1f} {r['saving_ms']:>10.1f} {r['ratio']:>6.2f}×"
            + ("" if r["pulls"] else "  (below threshold: recompute)")
        )
    if rng:
        lines += [
            "  over the terms' ranges (each term at its low or high end, every combination):",
            f"  {'prompt':>7} {'OFF ms':>17} {'ON ms':>17} {'OFF/ON':>13}  dominant",
        ]
        for r in rng["ttft"]:
            lines.append(
                f"  {r['prompt_tokens']:>7} {_pair(r['off_ms'], '.0f'):>17} "
                f"{_pair(r['on_ms'], '.0f'):>17} {_pair(r['ratio'], '.2f'):>13}  "
                f"{r['ratio_dominant']}"
            )
        lines.append("  term ranges (multipliers of the value above):")
        lines += [
            f"    - {t['term']}: x{t['low']:g}-x{t['high']:g}: {t['source']}" for t in rng["terms"]
        ]
    wl = plan["workload"]
    lines += [
        "",
        f"decoder_kv_blocks_ttl: {wl['conversations_per_s']:g} conversations/s per D, "
        f"{wl['turns']} turns, gap {wl['turn_gap']} (mean {wl['mean_gap_s']:.1f} s):",
        f"  {'TTL s':>7} {'expired':>8} {'held tokens':>12} {'held GiB':>9} {'GiB/GPU':>8}",
    ]
    for r in plan["ttl"]:
        lines.append(
            f"  {r['ttl_s']:>7g} {r['miss_fraction']:>8.1%} {r['held_tokens']:>12,.0f} "
            f"{r['held_gib']:>9.2f} {r['held_gib_per_gpu']:>8.2f}"
        )
    lines += [
        f"  recommended TTL: {plan['recommended_ttl_s']:g} s — {plan['ttl_reason']}",
        "",
    ]
    lines += _decode_lines(plan.get("decode_side"), plan["ttl"])
    return "\n".join(lines + _check_lines(plan["calibration_check"], plan.get("checked_run")))


def _decode_lines(d: dict[str, Any] | None, ttl: list[dict[str, Any]]) -> list[str]:
    if d is None:
        return [
            "Decode side: not planned (give --d-kv-gib, D's KV pool, and --decode-concurrency)",
            "",
        ]
    lines = [
        f"Decode side: D's pool {d['pool_gib']:.1f} GiB, {d['concurrency']} requests decoding "
        f"hold {d['running_gib']:.1f} GiB; {d['room_gib']:.1f} GiB left for retained turns "
        f"(bidir_kv_retention_budget {d['budget_share']:.2f})",
        f"  {'TTL s':>7} {'of D':>6}  beside the running batch",
    ]
    for r in ttl:
        key = str(r["ttl_s"])
        fits = "overflows: preemptions (TPOT) or waits (TTFT)" if d["overflows"][key] else "fits"
        lines.append(f"  {r['ttl_s']:>7g} {d['share_of_pool'][key]:>6.0%}  {fits}")
    step = d["decode_step_ms"]
    hbm = d["pull_hbm_ms"]
    lines.append(
        f"  a {d['pull_tokens']}-token pull reads {hbm:.2f} ms of one D rank's memory time"
        + (
            f", {hbm / step:.1%} of one {step:.2f} ms decode step once per pull (the "
            "threshold weighs P's time; D's decode loses this much)"
            if step
            else ""
        )
    )
    return [*lines, ""]


def _num(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:,.0f}"


def _pair(pair: list[float], fmt: str) -> str:
    return f"{format(pair[0], fmt)}-{format(pair[1], fmt)}"


def _check_lines(rows: list[dict[str, Any]], against: str | None = None) -> list[str]:
    """The calibration next to its own run: router prefill per request, ms.

    ``wait``: the part of the prediction that is contention (clients waiting for
    each other's compute on P, replayed from the run's arrivals).
    """
    if not rows:
        return []

    def cell(m: float | None, p: float | None, wait: float) -> str:
        err = CheckRow.error(m, p)
        if m is None or p is None or err is None:
            return f"{'-':>33}"
        return f"{m:>9.1f} {p:>9.1f} {wait:>6.1f} {err:>+6.0%}"

    head = f"{'meas':>9} {'pred':>9} {'wait':>6} {'err':>6}"
    lines = [
        (
            "Calibration against its own run (router prefill per request, ms):"
            if against is None
            else f"The cost model against {against} (router prefill per request, ms):"
        ),
        f"  {'point':>7}  {'OFF ' + head.lstrip():>33}  {'ON ' + head.lstrip():>33}",
    ]
    notes = []
    for r in rows:
        lines.append(
            f"  {r['point']:>7}  {cell(r['off_ms'], r['off_pred_ms'], r['off_wait_ms'])}  "
            f"{cell(r['on_ms'], r['on_pred_ms'], r['on_wait_ms'])}"
        )
        notes += [
            f"  {r['point']} {leg.upper()}: {tail_text(Tail(**t))}"
            for leg in ("off", "on")
            if (t := r[f"{leg}_tail"]) is not None
        ]
    if notes:
        lines += ["  tails (the router's histogram; a miss there is a few requests, not a term):"]
    return [*lines, *notes, ""]


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        plan = run_plan(args)
    except (PlanError, ModelConfigError, ResultError, DistributionError) as exc:
        print(f"bidir-kv plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan, indent=1, default=str))
    else:
        print(render_text(plan))
    return 0
