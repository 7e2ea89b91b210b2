"""The headline's reliability, the emulator's measured overhead, and the ON prefill of
reuse turns only (synthetic result directories; no processes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bidir_kv.bench.overhead import Load, cpu_seconds, point_overhead
from bidir_kv.bench.results import load_result
from bidir_kv.bench.split import on_prefill_split, reuse_prefill_ms
from bidir_kv.bench.summary import summarize_result
from bidir_kv.report.headline import headline, headline_text
from suites.unit.test_bench_report import POINTS, make_result

ROUTER_LOG = """\
INFO [r1] conv=c0: cache MISS
INFO [r1] Prefill done in 400ms
INFO [r2] conv=c0: sending D's cached blocks to P (remote_request_id=x)
INFO [r2] Prefill done in 30ms
INFO [r3] conv=c1: sending D's cached blocks to P (remote_request_id=y)
INFO [r3] Prefill done in 50ms
"""


def _with_overhead(root: Path, *, load1: float, engine_cpu_ms: float, log: str = "") -> Path:
    out = make_result(root)
    manifest = json.loads((out / "manifest.json").read_text())
    log_path = out / "router.log"
    log_path.write_text(log)
    manifest["nodes"] = {"on": {"router0": {"log": str(log_path)}}}
    runs: dict[str, dict[str, object]] = {"off": {}, "on": {}}
    for leg in runs:
        for point in POINTS:
            runs[leg][str(point)] = {
                "overhead": {
                    "prefill_cpu_ms_per_request": engine_cpu_ms,
                    "own_cpu_share": 0.25,
                    "load1": [load1, load1],
                    "cores": 2,
                },
                "router_log": {"router0": [0, len(log.encode())]},
            }
    manifest["runs"] = runs
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_reuse_turns_prefill_is_read_from_the_router_log() -> None:
    assert reuse_prefill_ms(ROUTER_LOG) == [30.0, 50.0]  # r1 is a miss (turn 1)


def test_on_prefill_split_uses_reuse_turns_only(tmp_path: Path) -> None:
    summary = summarize_result(
        load_result(_with_overhead(tmp_path, load1=0.0, engine_cpu_ms=0.1, log=ROUTER_LOG))
    )
    split = on_prefill_split(summary, 4000)
    assert split is not None
    prefill, xfer, compute = split
    assert prefill == pytest.approx(40.0)  # mean of 30 and 50; the 400 ms miss left out
    assert xfer == pytest.approx(6 * (1 + 4000 * 2e-3) / 2)  # P's 6 transfers over 2 reuses
    assert compute == pytest.approx(prefill - xfer)


def test_headline_is_trusted_on_a_quiet_machine(tmp_path: Path) -> None:
    summary = summarize_result(load_result(_with_overhead(tmp_path, load1=0.6, engine_cpu_ms=0.1)))
    h = headline(summary)
    assert h is not None and h.point == max(POINTS)
    assert h.reliable, h.problems
    assert "NOT reliable" not in headline_text(h)


def test_headline_refuses_under_foreign_load_or_large_overhead(tmp_path: Path) -> None:
    busy = headline(
        summarize_result(load_result(_with_overhead(tmp_path / "a", load1=8.0, engine_cpu_ms=0.1)))
    )
    assert busy is not None and not busy.reliable
    assert any("foreign load" in p for p in busy.problems)
    assert "NOT reliable" in headline_text(busy)
    # P's CPU per request equal to the emulated ON prefill: 100 %, far over the limit
    quiet = headline(
        summarize_result(load_result(_with_overhead(tmp_path / "c", load1=0.0, engine_cpu_ms=0.0)))
    )
    assert quiet is not None and quiet.on_prefill_ms
    heavy = headline(
        summarize_result(
            load_result(
                _with_overhead(tmp_path / "b", load1=0.0, engine_cpu_ms=quiet.on_prefill_ms)
            )
        )
    )
    assert heavy is not None and not heavy.reliable
    assert heavy.overhead_share == pytest.approx(1.0)
    assert any("own CPU" in p for p in heavy.problems)


def test_point_overhead_per_request_and_share() -> None:
    ov = point_overhead(
        {"prefill-0": 1.0, "decode-0": 2.0, "router-0": 0.5},
        {"prefill-0": 1.5, "decode-0": 2.3, "router-0": 0.7},
        Load(1.0, 2),
        Load(3.0, 2),
        duration_s=2.0,
        requests=4,
    )
    assert ov["prefill_cpu_ms_per_request"] == pytest.approx(125.0)  # 0.5 s over 4
    assert ov["engine_cpu_ms_per_request"] == pytest.approx(200.0)  # P + D: 0.8 s
    assert ov["cpu_ms_per_request"] == pytest.approx(250.0)
    assert ov["own_cpu_share"] == pytest.approx(1.0 / 4.0)
    assert ov["load1"] == [1.0, 3.0]


def test_cpu_seconds_of_this_process_grow() -> None:
    before = cpu_seconds(os.getpid())
    assert before is not None
    sum(i * i for i in range(300_000))
    after = cpu_seconds(os.getpid())
    assert after is not None and after >= before
    assert cpu_seconds(2**22 + 12345) is None  # no such process


def test_a_real_engines_cpu_is_not_judged_as_overhead(tmp_path: Path) -> None:
    out = _with_overhead(tmp_path, load1=0.0, engine_cpu_ms=10_000.0)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["topology"] = "vllm-cpu"
    (out / "manifest.json").write_text(json.dumps(manifest))
    h = headline(summarize_result(load_result(out)))
    assert h is not None
    assert h.reliable, h.problems  # P's CPU is its prefill on real vLLM
    text = headline_text(h)
    assert "not judged (real engines" in text and "--time-scale" not in text
    manifest["topology"] = "emulator"  # the same CPU on the emulator is 100s of % overhead
    (out / "manifest.json").write_text(json.dumps(manifest))
    h = headline(summarize_result(load_result(out)))
    assert h is not None and any("own CPU" in p for p in h.problems)


def _two_clients_at(out: Path, leg: str, point: int, *, overlapped: bool) -> None:
    """Rewrite one leg's records at ``point``: two clients whose turns overlap (the
    second starts 100 ms into the first's 800 ms TTFT) or are staggered (it starts as
    the first's TTFT ends)."""
    from bidir_kv.bench.runner import point_name
    from bidir_kv.bench.stats import write_records
    from suites.unit.test_bench_report import rec

    offset = 100.0 if overlapped else 900.0
    recs = []
    for turn in (1, 2, 3):
        for client in (0, 1):
            r = rec(leg, point, turn, 800.0, f"c{client}")
            r.client_id = client
            r.start_time_ms = turn * 5000.0 + client * offset
            recs.append(r)
    write_records(out / leg / f"{point_name(point)}.stats.json", recs)


@pytest.mark.parametrize(("off_overlapped", "on_overlapped"), [(True, False), (False, True)])
def test_headline_phase_state_is_the_off_legs(
    tmp_path: Path, off_overlapped: bool, on_overlapped: bool
) -> None:
    """The headline says which phase state the OFF figure ran in: read from the OFF
    leg's turns, whatever the ON leg's clients did."""
    out = _with_overhead(tmp_path, load1=0.6, engine_cpu_ms=0.1)
    point = max(POINTS)
    _two_clients_at(out, "off", point, overlapped=off_overlapped)
    _two_clients_at(out, "on", point, overlapped=on_overlapped)
    h = headline(summarize_result(load_result(out)))
    assert h is not None and h.point == point
    measured = 4  # turns 2 and 3 of both clients (min_turn 2)
    assert h.off_overlapped == ((measured if off_overlapped else 0), measured)
    state = "overlapped clients" if off_overlapped else "staggered clients"
    assert f"{h.off_overlapped[0]} of {measured} ({state}" in headline_text(h)
