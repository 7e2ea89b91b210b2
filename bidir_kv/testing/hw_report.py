"""The hardware tier's outputs under ``--hw-report`` (default ``out/hardware``):

* ``benchmark.json``: the round-time stats of every measurement test (pytest-benchmark's
  JSON layout: ``benchmarks[].{name, fullname, stats, extra_info}``) plus the gate outcomes;
* ``junit.xml``: the tier's tests alone, for the release gate script;
* ``report.md`` with ``ttft.png`` and ``prefill.png``: per length OFF vs ON, the bound,
  the mechanism numbers, every gate's result.

A pytest plugin (loaded by :mod:`bidir_kv.testing.plugin`); it writes only when a
hardware test ran. Under xdist each worker measures and reports for itself, into
``--hw-report``/<worker id>.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any
from xml.sax.saxutils import quoteattr

import pytest

from bidir_kv.testing.hw_options import hw_options

__all__ = ["record_benchmark", "record_gate"]

_BENCH: pytest.StashKey[list[dict[str, Any]]] = pytest.StashKey()
_GATES: pytest.StashKey[list[dict[str, Any]]] = pytest.StashKey()
_CASES: pytest.StashKey[list[dict[str, Any]]] = pytest.StashKey()


def record_benchmark(
    config: pytest.Config, nodeid: str, round_s: list[float], extra_info: dict[str, Any]
) -> None:
    """Keep one measurement's round times as pytest-benchmark's stats would show them."""
    data = list(round_s)
    stats: dict[str, Any] = {
        "min": min(data, default=None),
        "max": max(data, default=None),
        "mean": statistics.fmean(data) if data else None,
        "median": statistics.median(data) if data else None,
        "stddev": statistics.stdev(data) if len(data) > 1 else 0.0,
        "rounds": len(data),
        "iterations": 1,
        "data": data,
    }
    entry = {
        "name": nodeid.rsplit("::", 1)[-1],
        "fullname": nodeid,
        "stats": stats,
        "extra_info": dict(extra_info),
    }
    config.stash.setdefault(_BENCH, []).append(entry)


def record_gate(config: pytest.Config, length: int, gate: str, ok: bool, detail: str) -> None:
    config.stash.setdefault(_GATES, []).append(
        {"length": length, "gate": gate, "ok": ok, "detail": detail}
    )


def _in_tier(item_path: str) -> bool:
    return "suites/hardware/" in item_path.replace("\\", "/")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not _in_tier(str(item.fspath)):
        return
    if report.when == "call" or report.outcome != "passed":
        item.config.stash.setdefault(_CASES, []).append(
            {
                "nodeid": report.nodeid,
                "when": report.when,
                "outcome": report.outcome,
                "duration": report.duration,
                "message": str(report.longrepr)[-4000:] if report.failed else "",
            }
        )


def _junit(cases: list[dict[str, Any]]) -> str:
    failures = sum(c["outcome"] == "failed" for c in cases)
    skipped = sum(c["outcome"] == "skipped" for c in cases)
    lines = [
        '<?xml version="1.0" encoding="utf-8"?>',
        f'<testsuite name="hardware" tests="{len(cases)}" failures="{failures}" '
        f'skipped="{skipped}" errors="0">',
    ]
    for c in cases:
        cls, _, name = c["nodeid"].rpartition("::")
        head = (
            f"  <testcase classname={quoteattr(cls)} name={quoteattr(name)} "
            f'time="{c["duration"]:.3f}"'
        )
        if c["outcome"] == "failed":
            lines += [
                head + ">",
                f"    <failure message={quoteattr(c['message'][-300:])}/>",
                "  </testcase>",
            ]
        elif c["outcome"] == "skipped":
            lines += [head + ">", "    <skipped/>", "  </testcase>"]
        else:
            lines.append(head + "/>")
    lines.append("</testsuite>")
    return "\n".join(lines) + "\n"


def _ms(values: list[float]) -> float | None:
    return statistics.median(values) * 1e3 if values else None


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def _plots(rows: list[dict[str, Any]], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    lengths = [r["history_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(lengths, [_ms(r["off_s"]) or 0.0 for r in rows], "o-", label="OFF (recompute)")
    ax.plot(lengths, [_ms(r["on_s"]) or 0.0 for r in rows], "o-", label="ON (readback)")
    ax.set(
        xlabel="history tokens",
        ylabel="turn-2 prefill time on P, median (ms)",
        title="TTFT vs prompt length",
    )
    ax.legend()
    fig.savefig(out / "ttft.png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(rows))
    xfer = [_ms(r["xfer_s"]) or 0.0 for r in rows]
    on = [_ms(r["on_s"]) or 0.0 for r in rows]
    ax.bar([x - 0.2 for x in xs], [_ms(r["off_s"]) or 0.0 for r in rows], 0.4, label="OFF")
    ax.bar(
        [x + 0.2 for x in xs],
        [max(o - t, 0.0) for o, t in zip(on, xfer, strict=True)],
        0.4,
        label="ON: compute",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        xfer,
        0.4,
        bottom=[max(o - t, 0.0) for o, t in zip(on, xfer, strict=True)],
        label="ON: KV transfer",
    )
    ax.set_xticks(list(xs), [str(n) for n in lengths])
    ax.set(xlabel="history tokens", ylabel="ms (median)", title="Prefill duration")
    ax.legend()
    fig.savefig(out / "prefill.png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return ["ttft.png", "prefill.png"]


def _markdown(
    rows: list[dict[str, Any]],
    gates: list[dict[str, Any]],
    info: dict[str, Any],
    cases: list[dict[str, Any]],
    plots: list[str],
) -> str:
    passed = sum(c["outcome"] == "passed" for c in cases)
    lines = [
        "# bidir-kv hardware tier report",
        "",
        f"- deployment: `{info.get('kind', 'n/a')}`, block size {info.get('block_size')}, "
        f"KV bytes/token {info.get('kv_bytes_per_token')}",
        f"- placement: launcher `{info.get('launcher', 'n/a')}`, hosts "
        f"{', '.join(map(str, info.get('hosts') or [])) or 'n/a'}; fabric: "
        f"{info.get('fabric', 'n/a')}",
        f"- tests: {passed} passed of {len(cases)}",
        "",
        "| history | prompt | OFF ms | ON ms | speedup | pulled tokens | MB moved | Gb/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mb = statistics.median(r["bytes_moved"]) / 2**20 if r["bytes_moved"] else None
        pulled = statistics.median(r["pulled_tokens"]) if r["pulled_tokens"] else None
        lines.append(
            f"| {r['history_tokens']} | {r['prompt_tokens']} | {_fmt(_ms(r['off_s']))} "
            f"| {_fmt(_ms(r['on_s']))} | {_fmt(r['speedup'], '.3f')} | "
            f"{_fmt(pulled, '.0f')} | {_fmt(mb, '.2f')} | {_fmt(r['gbps'], '.2f')} |"
        )
    lines += ["", "| length | gate | result | detail |", "|---|---|---|---|"]
    for g in gates:
        detail = g["detail"].replace("|", "/").replace("\n", " ")
        lines.append(
            f"| {g['length']} | {g['gate']} | {'PASS' if g['ok'] else 'FAIL'} | {detail} |"
        )
    lines.append("")
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from bidir_kv.testing.hardware import deployment_info, hw_results

    config = session.config
    cases = config.stash.get(_CASES, [])
    if not cases:
        return
    out = hw_options(config).report
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker:  # an xdist worker: its own tests and measurements, beside the others'
        out = out / str(worker)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r.to_dict() for _, r in sorted(hw_results(config).items())]
    gates = config.stash.get(_GATES, [])
    info = deployment_info(config)
    bench = {
        "datetime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "deployment": info,
        "benchmarks": config.stash.get(_BENCH, []),
        "lengths": rows,
        "gates": gates,
    }
    (out / "benchmark.json").write_text(json.dumps(bench, indent=1, default=str))
    (out / "junit.xml").write_text(_junit(cases))
    plots = _plots(rows, out) if rows else []
    (out / "report.md").write_text(_markdown(rows, gates, info, cases, plots))
