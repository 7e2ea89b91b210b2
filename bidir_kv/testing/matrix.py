"""The conformance matrix of one run: scenario x backend x model family x proxy -> outcome.

One run is one vLLM release (``--vllm-version``); each row records the release and
model family it ran on, so ``bidir-kv conformance-report`` (:mod:`bidir_kv.report.compat`)
can merge the runs of many releases into one release x family x scenario table. A
row that was an expected upstream defect carries the pin's upstream record and
release range (:mod:`bidir_kv.testing.exemptions`).

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

from bidir_kv.testing.exemptions import EXEMPTIONS, exemption_for, release_key
from bidir_kv.testing.families import split_backend_id

__all__ = [
    "MATRIX_FORMAT",
    "Matrix",
    "backend_release",
    "in_tier",
    "matrix_of",
    "record",
    "write",
]


@dataclass
class _Row:
    scenario: str
    params: str
    backend: str
    proxy: str
    outcome: str
    reason: str
    duration: float
    family: str = "dense"
    release: str | None = None
    # an expected upstream defect: the pin's key, upstream record and release range
    defect: dict[str, Any] | None = None


class Matrix:
    """Rows by test id, and what each backend reported about itself (or why it did not start)."""

    def __init__(self) -> None:
        self.rows: dict[str, _Row] = {}
        self.backends: dict[str, Any] = {}


_KEY = pytest.StashKey[Matrix]()
# matrix.json's layout: 2 added release, family and defect to each result
MATRIX_FORMAT = 2


def matrix_of(config: pytest.Config) -> Matrix:
    """The session's matrix (created on first use)."""
    if _KEY not in config.stash:
        config.stash[_KEY] = Matrix()
    return config.stash[_KEY]


def in_tier(item: pytest.Item) -> bool:
    """Whether ``item`` is a conformance scenario (lives under ``suites/conformance/``)."""
    parts = Path(str(item.fspath)).parts
    return "suites" in parts and "conformance" in parts


def backend_release(config: pytest.Config, backend: str) -> str | None:
    """The vLLM release a backend runs (or emulates), known before it starts: what the
    exemptions are keyed by. ``None`` for an external deployment of unknown release."""
    if backend.startswith("vllm-cpu"):
        from bidir_kv.topology.vllm_cpu import VLLM_CPU_VERSION

        release = config.getoption("--vllm-version") or VLLM_CPU_VERSION
        try:
            release_key(release)
        except ValueError as exc:
            raise pytest.UsageError(f"--vllm-version: {exc}") from None
        return str(release)
    if backend == "emulator":
        return f"{config.getoption('--emulate-vllm')}.0"
    return None


def record(item: pytest.Item, rep: pytest.TestReport) -> None:
    """Fold one phase's report (setup, call or teardown) into the item's row."""
    callspec = getattr(item, "callspec", None)
    params = dict(callspec.params) if callspec else {}
    backend, family = split_backend_id(str(params.pop("pd", "-")))
    proxy = str(params.pop("proxy", "direct"))
    matrix = matrix_of(item.config)
    row = matrix.rows.get(item.nodeid)
    state = _state(rep)
    if row is None:
        scenario = getattr(item, "originalname", item.name)
        release = backend_release(item.config, backend) if backend != "-" else None
        row = _Row(
            scenario,
            ",".join(f"{k}={_value(v)}" for k, v in sorted(params.items())),
            backend,
            proxy,
            "passed",
            "",
            0.0,
            family,
            release,
        )
        pin = exemption_for(scenario, backend, params, release, family)
        if pin is not None:
            row.defect = _defect(pin)
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


def _value(v: Any) -> str:
    """A parameter as its test id shows it (a tuple ``("fail", "sync")`` as fail-sync)."""
    return "-".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _defect(pin: Any) -> dict[str, Any]:
    """What the report needs of a pin: the defect's name, its upstream record, the
    releases it holds for, and for an unfiled one how to reproduce it."""
    defect = pin.defect
    return {
        "defect": defect.key if defect is not None else pin.reason[:60],
        "what": defect.what if defect is not None else "",
        "upstream": pin.upstream.label,
        "number": pin.upstream.number,
        "kind": pin.upstream.kind,
        "url": pin.upstream.url,
        "first": pin.releases.first,
        "last": pin.releases.last,
        "reason": pin.reason,
        "reproduce": pin.reproduce,
    }


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
    rows = sorted(
        matrix.rows.values(), key=lambda r: (r.scenario, r.params, r.proxy, r.backend, r.family)
    )
    doc = {
        "format": MATRIX_FORMAT,
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count()},
        "backends": matrix.backends,
        "exemptions": {
            f"{s}[{','.join(f'{k}={v}' for k, v in e.params)}] @ {b}": {
                "reason": e.reason,
                "evidence": e.evidence,
                "upstream": e.upstream.label,
                "releases": str(e.releases),
                "families": list(e.families),
                "reproduce": e.reproduce,
            }
            for (s, b), exs in EXEMPTIONS.items()
            for e in exs
        },
        "results": [r.__dict__ for r in rows],
    }
    (out / "matrix.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / "matrix.md").write_text(_markdown(doc, rows))


def _column(r: _Row) -> str:
    return r.backend if r.family == "dense" else f"{r.backend}@{r.family}"


def _markdown(doc: dict[str, Any], rows: list[_Row]) -> str:
    backends = sorted({_column(r) for r in rows})
    cells: dict[tuple[str, str, str], dict[str, _Row]] = {}
    for r in rows:
        cells.setdefault((r.scenario, r.params, r.proxy), {})[_column(r)] = r
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
