"""The conformance matrix: scenario x backend x proxy -> outcome and reason.

A passed scenario may carry a reason too: the outcome it recorded as documented on that
backend (``record_property("documented", ...)``), e.g. the 404 vLLM 0.32 answers a route
it does not have.

The conformance plugin feeds it every report of a test under ``suites/conformance/``
(:func:`record`) and writes it at the end of the session (:func:`write`)
as ``matrix.md`` and ``matrix.json``, with the backends' descriptions and the pinned
exemptions. A plain module, not a plugin: the hooks live in
:mod:`bidir_kv.testing.conformance`.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.testing.exemptions import EXEMPTIONS

__all__ = ["Matrix", "in_tier", "matrix_of", "record", "write"]


@dataclass
class _Row:
    scenario: str
    params: str
    backend: str
    proxy: str
    outcome: str
    reason: str
    duration: float


class Matrix:
    """Rows by test id, and what each backend reported about itself (or why it did not start)."""

    def __init__(self) -> None:
        self.rows: dict[str, _Row] = {}
        self.backends: dict[str, Any] = {}


_KEY = pytest.StashKey[Matrix]()


def matrix_of(config: pytest.Config) -> Matrix:
    """The session's matrix (created on first use)."""
    if _KEY not in config.stash:
        config.stash[_KEY] = Matrix()
    return config.stash[_KEY]


def in_tier(item: pytest.Item) -> bool:
    """Whether ``item`` is a conformance scenario (lives under ``suites/conformance/``)."""
    parts = Path(str(item.fspath)).parts
    return "suites" in parts and "conformance" in parts


def record(item: pytest.Item, rep: pytest.TestReport) -> None:
    """Fold one phase's report (setup, call or teardown) into the item's row."""
    callspec = getattr(item, "callspec", None)
    params = dict(callspec.params) if callspec else {}
    backend = str(params.pop("pd", "-"))
    proxy = str(params.pop("proxy", "direct"))
    matrix = matrix_of(item.config)
    row = matrix.rows.get(item.nodeid)
    state = _state(rep)
    if row is None:
        row = _Row(
            getattr(item, "originalname", item.name),
            ",".join(f"{k}={v}" for k, v in sorted(params.items())),
            backend,
            proxy,
            "passed",
            "",
            0.0,
        )
        matrix.rows[item.nodeid] = row
    row.duration += rep.duration
    documented = _documented(rep)
    if documented is not None:
        row.reason = documented
    if state is None:
        return
    name, reason = state
    if rep.when != "teardown" or row.outcome in ("passed", "xfail", "xpass"):
        row.outcome, row.reason = (name if rep.when != "teardown" else "error"), reason


def _documented(rep: pytest.TestReport) -> str | None:
    """What a passed scenario recorded as its documented outcome on this backend
    (``record_property("documented", ...)``, e.g. a route vLLM 0.32 answers with 404)."""
    if rep.when != "call" or not rep.passed:
        return None
    notes = [str(v) for k, v in rep.user_properties if k == "documented"]
    return "; ".join(notes) or None


def _state(rep: pytest.TestReport) -> tuple[str, str] | None:
    wasxfail = getattr(rep, "wasxfail", None)
    if rep.skipped and wasxfail is not None:
        return "xfail", str(wasxfail)
    if rep.passed and wasxfail is not None:
        return ("xpass", str(wasxfail)) if rep.when == "call" else None
    if rep.skipped:
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        return "skip", reason.removeprefix("Skipped: ")
    if rep.failed:
        text = str(rep.longreprtext or "").strip().splitlines()
        # the first "E" line names the exception and its message; later ones detail it
        msg = next((ln for ln in text if ln.startswith("E ")), text[-1] if text else "")
        return ("fail" if rep.when == "call" else "error"), msg[:300]
    return None


def write(config: pytest.Config, out: Path) -> None:
    """Write ``matrix.json`` and ``matrix.md`` to ``out`` (nothing when no scenario ran)."""
    matrix = config.stash.get(_KEY, None)
    if matrix is None or not matrix.rows:
        return
    out.mkdir(parents=True, exist_ok=True)
    rows = sorted(matrix.rows.values(), key=lambda r: (r.scenario, r.params, r.proxy, r.backend))
    doc = {
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count()},
        "backends": matrix.backends,
        "exemptions": {
            f"{s}[{','.join(f'{k}={v}' for k, v in e.params)}] @ {b}": {
                "reason": e.reason,
                "evidence": e.evidence,
            }
            for (s, b), exs in EXEMPTIONS.items()
            for e in exs
        },
        "results": [r.__dict__ for r in rows],
    }
    (out / "matrix.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / "matrix.md").write_text(_markdown(doc, rows))


def _markdown(doc: dict[str, Any], rows: list[_Row]) -> str:
    backends = sorted({r.backend for r in rows})
    cells: dict[tuple[str, str, str], dict[str, _Row]] = {}
    for r in rows:
        cells.setdefault((r.scenario, r.params, r.proxy), {})[r.backend] = r
    lines = [
        "# Conformance matrix",
        "",
        f"Generated {doc['generated']} on {doc['machine']['arch']} "
        f"({doc['machine']['cpus']} CPUs).",
        "",
        "| scenario | params | proxy | " + " | ".join(backends) + " |",
        "|---|---|---|" + "---|" * len(backends),
    ]
    notes: list[str] = []
    for (scenario, params, proxy), by_backend in cells.items():
        out = []
        for b in backends:
            found = by_backend.get(b)
            if found is None:
                out.append("")
                continue
            r = found
            cell = r.outcome
            if r.reason:  # why it did not pass, or a passed scenario's documented outcome
                notes.append(
                    f"- `{scenario}[{params}]` {proxy} on **{b}** ({r.outcome}): "
                    f"{r.reason.replace('|', '/')}"
                )
                cell += f" [{len(notes)}]"
            out.append(cell)
        lines.append(f"| {scenario} | {params or '-'} | {proxy} | " + " | ".join(out) + " |")
    if notes:
        lines += ["", "## Reasons", "", *notes]
    if doc["exemptions"]:
        lines += ["", "## Exemptions (known upstream defects)", ""]
        for key, ex in doc["exemptions"].items():
            lines.append(f"- **{key}**: {ex['reason']} Evidence: {ex['evidence']}")
    lines += [
        "",
        "## Backends",
        "",
        "```json",
        json.dumps(doc["backends"], indent=1, default=str),
        "```",
        "",
    ]
    return "\n".join(lines)
