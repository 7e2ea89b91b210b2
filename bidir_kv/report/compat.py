"""``bidir-kv conformance-report RUN...``: the compatibility report across vLLM releases.

Reads the ``matrix.json`` that each conformance run writes (``--conformance-report``,
one run per vLLM release: ``pytest -m conformance --vllm-version X --model-family
all``) and renders one table, Markdown (``compat.md``) and HTML (``compat.html``):

* a column per backend, release and model family, a row per scenario;
* a cell says **pass**, **defect** (an expected upstream defect: a strict xfail, linked
  to the vLLM issue or PR by number, or to its description when not filed yet),
  **FAIL** (a failure, an error, or a pinned defect that no longer shows), **skip**
  (with why), **n/a** (the scenario is not generated for that model family) or
  **unsupported** (the backend does not claim that release);
* a defects table: each defect's upstream record, its first and last affected release
  as pinned, and the releases on which these runs showed it.

The layout of ``matrix.json`` is :mod:`bidir_kv.testing.matrix`'s (``format`` 2; a file
of format 1 has no release or family per row and is read as the pinned release's
dense family). This module reads only JSON: it never imports the test plugin.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bidir_kv.errors import ConfigError

__all__ = ["Cell", "Report", "build_report", "load_runs", "main", "render_html", "render_markdown"]

_BACKEND_ORDER = ("vllm-cpu", "vllm-cpu+bidir-kv", "external", "emulator")
_FAMILY_ORDER = ("dense", "hybrid", "moe", "mla")
_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


class ReportError(ConfigError):
    """An input that is not a conformance run's ``matrix.json``."""


def _release_key(release: str | None) -> tuple[int, int, int]:
    m = _RELEASE.match(release or "")
    if m is None:
        return (10**6, 0, 0)  # unknown releases last
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _order(value: str, known: Sequence[str]) -> tuple[int, str]:
    return (known.index(value) if value in known else len(known), value)


@dataclass(frozen=True)
class Column:
    backend: str
    release: str
    family: str

    @property
    def key(self) -> tuple[Any, ...]:
        return (
            _order(self.backend, _BACKEND_ORDER),
            _release_key(self.release),
            _order(self.family, _FAMILY_ORDER),
        )

    @property
    def title(self) -> str:
        return f"{self.backend} {self.release} {self.family}"


@dataclass
class Cell:
    """One scenario on one column: its state and what a reader needs to know."""

    state: str  # pass | defect | FAIL | skip | n/a | unsupported
    note: str = ""
    defect: str | None = None  # the defect's key in Report.defects


@dataclass
class Defect:
    key: str
    upstream: str
    url: str | None
    first: str
    last: str | None
    reason: str
    reproduce: str
    seen: set[str] = field(default_factory=set)  # releases where a run showed it


@dataclass
class Report:
    columns: list[Column]
    rows: list[str]
    cells: dict[tuple[str, Column], Cell]
    defects: dict[str, Defect]
    runs: list[dict[str, Any]]
    unsupported: dict[Column, str]


def _inputs(paths: Iterable[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(path.rglob("matrix.json"))
        elif path.is_file():
            found.append(path)
        else:
            raise ReportError(f"{path}: no such file or directory")
    if not found:
        raise ReportError("no matrix.json found in the given paths")
    return found


def load_runs(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every ``matrix.json`` under ``paths`` (files, or directories searched), checked."""
    runs = []
    for path in _inputs(paths):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ReportError(f"{path}: not readable JSON ({exc})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
            raise ReportError(f"{path}: not a conformance matrix.json (no 'results' list)")
        doc["_path"] = str(path)
        runs.append(doc)
    return runs


_TUPLE = re.compile(r"\(((?:'[^']*'(?:, )?)+)\)")


def _row_name(r: dict[str, Any]) -> str:
    name = str(r["scenario"])
    if r.get("params"):
        # a tuple parameter as its id (rows written before matrix.py did so themselves)
        params = _TUPLE.sub(lambda m: "-".join(re.findall(r"'([^']*)'", m.group(1))), r["params"])
        name += f"[{params}]"
    if r.get("proxy", "direct") != "direct":
        name += f" via {r['proxy']}"
    return name


_OLD_KEY = re.compile(r"^Defect\(key='([^']+)'")


def _defect_key(d: dict[str, Any]) -> str:
    if d.get("number"):
        return f"#{d['number']}"
    key = str(d.get("defect") or d.get("reason", "")[:60])
    # runs of 2026-12-04 before 09:00 wrote the pin's Defect object, not its key
    old = _OLD_KEY.match(key)
    return old.group(1) if old else key


def build_report(runs: list[dict[str, Any]], pinned: str = "0.32.0") -> Report:
    """Fold the runs into one table. A later run of the same cell wins."""
    cells: dict[tuple[str, Column], Cell] = {}
    defects: dict[str, Defect] = {}
    columns: set[Column] = set()
    unsupported: dict[Column, str] = {}
    # every family a run generated anything for, per (backend, release): a scenario
    # missing from such a column was not generated for that family (n/a)
    for run in sorted(runs, key=lambda d: str(d.get("generated", ""))):
        for key, desc in (run.get("backends") or {}).items():
            if isinstance(desc, dict) and "unsupported" in desc:
                backend, _, family = str(key).partition("@")
                col = Column(backend, str(desc.get("release") or pinned), family or "dense")
                columns.add(col)
                unsupported[col] = str(desc["unsupported"])
        for r in run["results"]:
            release = str(r.get("release") or (pinned if r["backend"] != "emulator" else "-"))
            col = Column(str(r["backend"]), release, str(r.get("family") or "dense"))
            columns.add(col)
            cell = _cell(r, col, defects)
            if col in unsupported and cell.state == "skip":
                cell = Cell("unsupported", unsupported[col])
            cells[(_row_name(r), col)] = cell
    rows = sorted({name for name, _ in cells})
    ordered = sorted(columns, key=lambda c: c.key)
    for row in rows:
        for col in ordered:
            if (row, col) in cells:
                continue
            if col in unsupported:
                cells[(row, col)] = Cell("unsupported", unsupported[col])
            elif any((row, c) in cells for c in ordered if c.backend == col.backend):
                cells[(row, col)] = Cell("n/a", "not generated for this model family")
    return Report(ordered, rows, cells, defects, runs, unsupported)


def _cell(r: dict[str, Any], col: Column, defects: dict[str, Defect]) -> Cell:
    outcome = str(r["outcome"])
    reason = re.sub(r"^E\s+", "", str(r.get("reason") or ""))  # pytest's "E   " prefix
    pin = r.get("defect")
    if outcome == "passed":
        return Cell("pass", reason)
    if outcome == "skip" and "unsupported" in reason.lower():
        return Cell("unsupported", reason)
    if outcome == "skip":
        return Cell("skip", reason)
    if outcome == "xfail" and isinstance(pin, dict):
        key = _defect_key(pin)
        # runs are folded oldest first: the latest run's pin (its range) is the one shown
        seen = defects[key].seen if key in defects else set()
        found = defects[key] = Defect(
            key,
            str(pin.get("upstream") or "not filed upstream yet"),
            pin.get("url"),
            str(pin.get("first") or "?"),
            pin.get("last"),
            str(pin.get("what") or pin.get("reason") or reason),
            str(pin.get("reproduce") or ""),
            seen,
        )
        found.seen.add(col.release)
        return Cell("defect", reason, key)
    if outcome == "xfail":  # a format-1 run: the pin's text is the reason
        m = re.search(r"vLLM (?:PR|issue) #(\d+)", reason)
        key = f"#{m.group(1)}" if m else reason[:60]
        found = defects.setdefault(key, Defect(key, key, None, "?", None, reason, ""))
        found.seen.add(col.release)
        return Cell("defect", reason, key)
    if outcome == "xpass":
        return Cell("FAIL", f"a pinned defect did not show (fixed upstream?): {reason}")
    return Cell("FAIL", reason)


# ---- rendering ------------------------------------------------------------------


def _summary(report: Report) -> list[tuple[Column, dict[str, int]]]:
    out = []
    for col in report.columns:
        counts: dict[str, int] = {}
        for row in report.rows:
            cell = report.cells.get((row, col))
            if cell is not None:
                counts[cell.state] = counts.get(cell.state, 0) + 1
        out.append((col, counts))
    return out


_STATES = ("pass", "defect", "FAIL", "skip", "n/a", "unsupported")


def _defect_label(d: Defect) -> str:
    return d.key if d.key.startswith("#") else "unfiled"


def render_markdown(report: Report) -> str:
    lines = [
        "# bidir-kv conformance: vLLM compatibility report",
        "",
        "Each column is one backend, vLLM release and model family; each row a scenario of the",
        "conformance catalogue (docs/conformance.md). **pass**; **defect**: an expected upstream",
        "defect (strict xfail; the defects table says which); **FAIL**: a failure, an error, or",
        "a pinned defect that no longer shows; **skip** (why, in the notes); **n/a**: not",
        "generated for that model family; **unsupported**: the backend does not claim that",
        "release.",
        "",
        "Runs: " + ", ".join(f"`{r['_path']}` ({r.get('generated', '?')})" for r in report.runs),
        "",
        "## Summary",
        "",
        "| backend | release | family | " + " | ".join(_STATES) + " |",
        "|---|---|---|" + "---:|" * len(_STATES),
    ]
    for col, counts in _summary(report):
        lines.append(
            f"| {col.backend} | {col.release} | {col.family} | "
            + " | ".join(str(counts.get(s, 0)) for s in _STATES)
            + " |"
        )
    lines += ["", "## Scenarios", ""]
    head = [f"{c.backend}<br>{c.release}<br>{c.family}" for c in report.columns]
    lines += ["| scenario | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    notes: list[str] = []

    def note(text: str) -> int:
        """The footnote number of ``text`` (one number per distinct text)."""
        if text not in notes:
            notes.append(text)
        return notes.index(text) + 1

    for row in report.rows:
        out = []
        for col in report.columns:
            cell = report.cells.get((row, col))
            if cell is None:
                out.append("")
                continue
            text = cell.state
            if cell.defect is not None:
                d = report.defects[cell.defect]
                text = (
                    f"defect {_defect_label(d)}" if d.url is None else f"defect [{d.key}]({d.url})"
                )
                if d.url is None:
                    text += f" [{note(f'{d.key}: {d.upstream} (see Defects)')}]"
            elif cell.state in ("FAIL", "skip", "unsupported") and cell.note:
                what = cell.note if cell.state != "FAIL" else f"`{row}` on {col.title}: {cell.note}"
                text += f" [{note(f'{cell.state}: {what}')}]"
            out.append(text)
        lines.append(f"| {row} | " + " | ".join(out) + " |")
    if notes:
        lines += ["", "Notes:", ""]
        lines += [f"{i}. {n.replace('|', '/')}" for i, n in enumerate(notes, 1)]
    lines += ["", "## Defects", ""]
    lines += [
        "| defect | upstream | first affected | last affected | shown in these runs on |",
        "|---|---|---|---|---|",
    ]
    for d in sorted(report.defects.values(), key=lambda d: d.key):
        up = f"[{d.upstream}]({d.url})" if d.url else d.upstream
        last = d.last or "open (no release we run has the fix)"
        seen = ", ".join(sorted(d.seen, key=_release_key))
        lines.append(f"| {d.key} | {up} | {d.first} | {last} | {seen} |")
    lines += ["", "### What each defect is", ""]
    for d in sorted(report.defects.values(), key=lambda d: d.key):
        lines.append(f"- **{d.key}** ({d.upstream}): {d.reason}")
        if d.reproduce:
            lines.append(f"  - To reproduce: {d.reproduce}")
    if report.unsupported:
        lines += ["", "## Unsupported", ""]
        for col, why in report.unsupported.items():
            lines.append(f"- {col.title}: {why}")
    return "\n".join(lines) + "\n"


_CSS = """
body { font-family: sans-serif; margin: 1.5em; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #bbb; padding: 3px 6px; vertical-align: top; }
th { background: #eee; }
td.pass { background: #d9f2d9; }
td.defect { background: #fff0c2; }
td.FAIL { background: #f7c6c6; font-weight: bold; }
td.skip { background: #e6e6e6; }
td.na, td.unsupported { background: #f7f7f7; color: #777; }
"""


def render_html(report: Report) -> str:
    e = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        "<title>bidir-kv conformance: vLLM compatibility</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>bidir-kv conformance: vLLM compatibility report</h1>",
        "<p>pass; <b>defect</b>: an expected upstream defect (strict xfail); <b>FAIL</b>: "
        "a failure or a pinned defect that no longer shows; skip; n/a: not generated for "
        "that model family; unsupported: the backend does not claim that release.</p>",
        "<h2>Scenarios</h2><table><tr><th>scenario</th>",
    ]
    parts += [f"<th>{e(c.backend)}<br>{e(c.release)}<br>{e(c.family)}</th>" for c in report.columns]
    parts.append("</tr>")
    for row in report.rows:
        parts.append(f"<tr><td>{e(row)}</td>")
        for col in report.columns:
            cell = report.cells.get((row, col))
            if cell is None:
                parts.append("<td></td>")
                continue
            css = "na" if cell.state == "n/a" else cell.state
            text = e(cell.state)
            if cell.defect is not None:
                d = report.defects[cell.defect]
                text = (
                    f"defect <a href='{e(d.url)}'>{e(d.key)}</a>"
                    if d.url
                    else f"defect <a href='#defects'>{e(_defect_label(d))}</a>"
                )
            parts.append(f"<td class='{css}' title='{e(cell.note)}'>{text}</td>")
        parts.append("</tr>")
    parts.append("</table><h2 id='defects'>Defects</h2><table>")
    parts.append(
        "<tr><th>defect</th><th>upstream</th><th>first affected</th><th>last affected</th>"
        "<th>shown on</th><th>what</th><th>to reproduce</th></tr>"
    )
    for d in sorted(report.defects.values(), key=lambda d: d.key):
        up = f"<a href='{e(d.url)}'>{e(d.upstream)}</a>" if d.url else e(d.upstream)
        seen = ", ".join(sorted(d.seen, key=_release_key))
        parts.append(
            f"<tr><td>{e(d.key)}</td><td>{up}</td><td>{e(d.first)}</td>"
            f"<td>{e(d.last or 'open')}</td><td>{e(seen)}</td><td>{e(d.reason)}</td>"
            f"<td>{e(d.reproduce)}</td></tr>"
        )
    parts.append("</table></body></html>\n")
    return "".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bidir-kv conformance-report",
        description="Merge conformance runs (matrix.json) of several vLLM releases into one "
        "compatibility report: compat.md and compat.html.",
    )
    ap.add_argument(
        "runs", nargs="+", type=Path, metavar="RUN", help="matrix.json, or a folder holding some"
    )
    ap.add_argument("--out", type=Path, default=Path("out/compat"), help="output folder")
    ap.add_argument(
        "--pinned",
        default="0.32.0",
        help="release a run without a per-row release ran (matrix.json format 1)",
    )
    args = ap.parse_args(argv)
    try:
        report = build_report(load_runs(args.runs), args.pinned)
    except ReportError as exc:
        print(f"bidir-kv conformance-report: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compat.md").write_text(render_markdown(report))
    (args.out / "compat.html").write_text(render_html(report))
    fails = sum(1 for c in report.cells.values() if c.state == "FAIL")
    print(
        f"{len(report.rows)} scenarios x {len(report.columns)} columns from "
        f"{len(report.runs)} run(s); {fails} FAIL; defects: "
        f"{', '.join(sorted(report.defects)) or 'none'}"
    )
    print(f"report: {args.out / 'compat.md'}  {args.out / 'compat.html'}")
    return 0
