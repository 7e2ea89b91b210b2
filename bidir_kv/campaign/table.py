"""The campaign's one table, plain text: load held, faults survived, bad inputs tried."""

from __future__ import annotations

from collections.abc import Sequence

from bidir_kv.campaign.faults import FaultResult
from bidir_kv.campaign.inputs import InputResult
from bidir_kv.campaign.load import LoadResult
from bidir_kv.campaign.sidebyside import Variant
from bidir_kv.campaign.sidebyside import render as render_waves

__all__ = ["render"]


def _status(status: int | None) -> str:
    return "no answer" if status is None else str(status)


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("yes" if ok else "NO")


def _rows(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{h:<{w}}" for h, w in zip(header, widths, strict=True))
    out = [line, "-" * len(line)]
    out += ["  ".join(f"{c!s:<{w}}" for c, w in zip(r, widths, strict=True)) for r in rows]
    return out


def _load(r: LoadResult, min_hit_rate: float) -> list[str]:
    rate = r.hit_rate
    rss = f"{r.router_rss / 2**20:.0f} MiB" if r.router_rss else "n/a"
    wrong = "n/a" if r.wrong is None else str(r.wrong)
    row = [
        f"{r.plan.conversations} x {r.plan.turns}",
        str(len(r.turns)),
        str(r.failed),
        wrong,
        "n/a" if rate is None else f"{rate * 100:.1f} %",
        "n/a" if r.pull_rate is None else f"{r.pull_rate * 100:.1f} %",
        f"{r.latency(0.5) * 1000:.0f} ms",
        f"{r.latency(0.99) * 1000:.0f} ms",
        rss,
        f"{r.seconds:.0f} s",
        "PASS" if r.holds(min_hit_rate) else "FAIL",
    ]
    head = [
        "conversations x turns",
        "turns",
        "failed",
        "wrong",
        "hit rate (turns>=2)",
        "P pulled (turns>=2)",
        "p50",
        "p99",
        "router RSS",
        "took",
        "result",
    ]
    return ["LOAD", *_rows(head, [row])]


def _faults(results: Sequence[FaultResult]) -> list[str]:
    head = ["fault", "client saw", "next turn correct", "recovered w/o restart", "took", "result"]
    rows = [
        [
            f.name,
            f.saw,
            _mark(f.next_correct),
            _mark(f.recovered),
            f"{f.seconds:.0f} s",
            "PASS" if f.holds else "FAIL",
        ]
        for f in results
    ]
    return ["FAULTS", *_rows(head, rows)]


def _inputs(results: Sequence[InputResult]) -> list[str]:
    targets = list(dict.fromkeys(r.target for r in results))
    names = list(dict.fromkeys(r.name for r in results))
    by = {(r.target, r.name): r for r in results}
    rows = []
    for name in names:
        cells = []
        for t in targets:
            r = by.get((t, name))
            cells.append(
                "-"
                if r is None
                else f"{_status(r.status)}{'' if r.ok else ' FAIL'}"
                f"{f' ({r.note})' if r.note else ''}"
            )
        rows.append([name, *cells])
    five = sum(
        1
        for r in results
        if (r.status is None and not r.ok) or (r.status is not None and r.status >= 500)
    )
    bad = sum(1 for r in results if not r.ok)
    return [
        "BAD INPUTS",
        *_rows(["input", *targets], rows),
        f"{len(results)} sent, 5xx or no answer: {five}, not as expected: {bad}",
    ]


def render(
    load: Sequence[LoadResult],
    faults: Sequence[FaultResult] | None,
    inputs: Sequence[InputResult] | None,
    min_hit_rate: float,
) -> str:
    parts: list[str] = []
    for r in load:
        parts += [*_load(r, min_hit_rate), ""]
    if faults is not None:
        parts += [*_faults(faults), ""]
        for f in faults:
            if f.wave is not None:  # d-full: what the wave cost, in detail
                parts += [
                    "D-FULL WAVE",
                    render_waves([Variant("this deployment", f)], f.wave.plan),
                    "",
                ]
    if inputs is not None:
        parts += [*_inputs(inputs), ""]
    return "\n".join(parts)
