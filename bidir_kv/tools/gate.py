"""The release gate: the tiers' results in, one pass/fail and a summary out.

    python -m bidir_kv.tools.gate --junit unit=out/junit-unit.xml --junit hardware=... \\
        --matrix out/conformance/matrix.json --benchmark out/hardware/benchmark.json \\
        [--bench out/bench-DIR [--max-tpot-regression PCT]] \\
        [--no-skips hardware] [--summary "$GITHUB_STEP_SUMMARY"]

Fails on: a tier with a failed or erroring test (JUnit), a skipped test in a tier named by
``--no-skips``, a conformance result that failed or passed against its pin (XPASS), an
expected failure whose exemption has no evidence or cites no upstream issue/PR, a
hardware gate that failed, a ``bench`` result whose ON leg's TPOT p99 exceeds its OFF leg's
by more than ``--max-tpot-regression`` percent at a point (the decode gate of the
hardware tier, on a whole OFF/ON session), and an input that is missing or unreadable
(docs/hardware.md §6).
"""

from __future__ import annotations

import argparse
import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bidir_kv.testing.hw_options import RELEASE_MAX_TPOT_REGRESSION

__all__ = ["Verdict", "check_bench", "check_benchmark", "check_junit", "check_matrix", "main"]

_CITATION = re.compile(r"#\d+")


@dataclass
class Verdict:
    """One input's outcome: a summary line and the reasons it fails (none: it passes)."""

    name: str
    summary: str
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def check_junit(name: str, path: Path, no_skips: bool = False) -> Verdict:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        return Verdict(name, "unreadable", [f"{name}: cannot read JUnit {path}: {exc}"])
    cases = list(root.iter("testcase"))
    failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    verdict = Verdict(name, f"{len(cases)} tests, {len(failed)} failed, {len(skipped)} skipped")
    if not cases:
        verdict.failures.append(f"{name}: no test ran ({path})")
    for case in failed:
        verdict.failures.append(f"{name}: {case.get('classname')}::{case.get('name')} failed")
    if no_skips:
        for case in skipped:
            verdict.failures.append(
                f"{name}: {case.get('classname')}::{case.get('name')} "
                "skipped in a tier that must run"
            )
    return verdict


def _load(path: Path, what: str) -> tuple[Any, str | None]:
    try:
        return json.loads(path.read_text()), None
    except (OSError, ValueError) as exc:
        return None, f"{what}: cannot read {path}: {exc}"


def check_matrix(path: Path) -> Verdict:
    doc, err = _load(path, "conformance")
    if err:
        return Verdict("conformance", "unreadable", [err])
    rows = doc.get("results") or []
    exemptions: dict[str, Any] = doc.get("exemptions") or {}
    counts: dict[str, int] = {}
    verdict = Verdict("conformance", "")
    for row in rows:
        outcome = str(row.get("outcome"))
        counts[outcome] = counts.get(outcome, 0) + 1
        cell = f"{row.get('scenario')}[{row.get('params')}] @ {row.get('backend')}"
        if outcome in ("failed", "error", "xpass", "xpassed"):
            verdict.failures.append(f"conformance: {cell} {outcome}")
        pinned = any(
            k.startswith(f"{row.get('scenario')}[") and k.endswith(f" @ {row.get('backend')}")
            for k in exemptions
        )
        if outcome == "xfail" and not pinned:
            verdict.failures.append(
                f"conformance: {cell} is an expected failure with no exemption on record"
            )
    for key, pin in exemptions.items():
        if not str(pin.get("evidence") or "").strip():
            verdict.failures.append(f"conformance: exemption {key} has no evidence")
        if not _CITATION.search(str(pin.get("reason") or "")):
            verdict.failures.append(f"conformance: exemption {key} cites no upstream issue/PR")
    if not rows:
        verdict.failures.append(f"conformance: no results in {path}")
    verdict.summary = ", ".join(f"{n} {o}" for o, n in sorted(counts.items())) or "empty"
    return verdict


def check_benchmark(path: Path) -> Verdict:
    doc, err = _load(path, "hardware")
    if err:
        return Verdict("hardware gates", "unreadable", [err])
    gates = doc.get("gates") or []
    lengths = [r.get("history_tokens") for r in doc.get("lengths") or []]
    verdict = Verdict(
        "hardware gates",
        f"{sum(bool(g.get('ok')) for g in gates)}/{len(gates)} gates passed over "
        f"lengths {lengths} on {(doc.get('deployment') or {}).get('kind')}",
    )
    if not gates:
        verdict.failures.append(f"hardware: no gate results in {path}")
    for g in gates:
        if not g.get("ok"):
            verdict.failures.append(
                f"hardware: {g.get('gate')} at {g.get('length')}: {g.get('detail')}"
            )
    return verdict


def check_bench(path: Path, max_tpot_regression: float, min_turn: int = 2) -> Verdict:
    """The decode gate on a ``bench`` result: per point, TPOT p99 of each ON leg against
    the OFF leg over turns >= ``min_turn`` (``testing.hw_gates.gate_tpot``)."""
    from bidir_kv.bench.results import ResultError, load_result
    from bidir_kv.bench.topo import leg_feature
    from bidir_kv.testing.hw_gates import GateFailure, gate_tpot

    name = f"bench {path.name}"
    try:
        result = load_result(path)
    except (ResultError, ValueError, OSError) as exc:
        return Verdict(name, "unreadable", [f"{name}: cannot read {path}: {exc}"])

    def tpots(leg: str, point: int) -> list[float]:
        recs = result.points[(leg, point)][0]
        return [
            r.tpot_ms / 1e3 for r in recs if r.ok and r.turn >= min_turn and r.output_num_tokens > 1
        ]

    verdict = Verdict(name, "")
    passed = []
    on_legs = [leg for leg in result.legs if leg_feature(leg) == "on"]
    for point in result.prefix_points:
        for leg in on_legs:
            if ("off", point) not in result.points or (leg, point) not in result.points:
                continue
            where = f"{name} point {point} leg {leg}"
            try:
                passed.append(
                    gate_tpot(where, tpots("off", point), tpots(leg, point), max_tpot_regression)
                )
            except GateFailure as exc:
                verdict.failures.append(str(exc))
    compared = len(passed) + len(verdict.failures)
    if not compared:
        verdict.failures.append(f"{name}: no point has both an OFF and an ON leg")
    verdict.summary = (
        f"TPOT p99 ON vs OFF within {max_tpot_regression:g} % at {len(passed)} of {compared} points"
    )
    return verdict


def _markdown(verdicts: Sequence[Verdict]) -> str:
    ok = all(v.ok for v in verdicts)
    lines = [
        f"## Release gate: {'PASS' if ok else 'FAIL'}",
        "",
        "| input | result | summary |",
        "|---|---|---|",
    ]
    lines += [f"| {v.name} | {'PASS' if v.ok else 'FAIL'} | {v.summary} |" for v in verdicts]
    failures = [f for v in verdicts for f in v.failures]
    if failures:
        lines += ["", "Failures:", ""] + [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def _junit_arg(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected TIER=PATH, got {text!r}")
    return name, Path(path)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bidir_kv.tools.gate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--junit", type=_junit_arg, action="append", default=[], metavar="TIER=PATH")
    p.add_argument("--matrix", type=Path, default=None, help="conformance matrix.json")
    p.add_argument("--benchmark", type=Path, default=None, help="hardware benchmark.json")
    p.add_argument(
        "--bench",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="a bidir-kv bench result: gate its decode side (repeatable)",
    )
    p.add_argument(
        "--max-tpot-regression",
        type=float,
        default=RELEASE_MAX_TPOT_REGRESSION,
        metavar="PCT",
        help="with --bench: TPOT p99 ON may exceed OFF by this many percent "
        f"(default {RELEASE_MAX_TPOT_REGRESSION:g}, the hardware tier's on a release)",
    )
    p.add_argument(
        "--bench-min-turn",
        type=int,
        default=2,
        help="with --bench: turns >= this are gated (default 2, as the report)",
    )
    p.add_argument(
        "--no-skips",
        action="append",
        default=[],
        metavar="TIER",
        help="a skipped test in TIER fails the gate (repeatable)",
    )
    p.add_argument("--summary", type=Path, default=None, help="also append the summary here")
    ns = p.parse_args(argv)
    verdicts = [check_junit(name, path, name in ns.no_skips) for name, path in ns.junit]
    if ns.matrix is not None:
        verdicts.append(check_matrix(ns.matrix))
    if ns.benchmark is not None:
        verdicts.append(check_benchmark(ns.benchmark))
    verdicts += [check_bench(d, ns.max_tpot_regression, ns.bench_min_turn) for d in ns.bench]
    if not verdicts:
        p.error("nothing to gate: pass --junit, --matrix, --benchmark or --bench")
    text = _markdown(verdicts)
    print(text, end="")
    if ns.summary is not None:
        with ns.summary.open("a") as fh:
            fh.write(text)
    return 0 if all(v.ok for v in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
