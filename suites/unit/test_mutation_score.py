"""The mutation gate: a score per covered package from mutmut's results, equivalent
mutants left out with their reasons, and a failing exit under the floor."""

from __future__ import annotations

import json
from pathlib import Path

from bidir_kv.tools.mutation_score import main, read_results, score


def _mutants(root: Path) -> Path:
    (root / "bidir_kv" / "policy").mkdir(parents=True)
    (root / "bidir_kv" / "policy" / "blocks.py.meta").write_text(
        json.dumps(
            {
                "exit_code_by_key": {
                    "bidir_kv.policy.blocks.x_cdiv__mutmut_1": 1,
                    "bidir_kv.policy.blocks.x_cdiv__mutmut_2": 1,
                    "bidir_kv.policy.blocks.x_cdiv__mutmut_3": 0,
                    "bidir_kv.policy.blocks.x_cdiv__mutmut_4": 0,
                    "bidir_kv.policy.blocks.x_cdiv__mutmut_5": 33,
                    "bidir_kv.policy.blocks.x_cdiv__mutmut_6": None,
                    "bidir_kv.policy.blocks.x_cdiv__mutmut_7": 36,
                }
            }
        )
    )
    (root / "bidir_kv" / "protocol.py.meta").write_text(
        json.dumps({"exit_code_by_key": {"bidir_kv.protocol.x_parse__mutmut_1": 0}})
    )
    return root


def test_score_counts_kills_survivors_untested_and_leaves_out_equivalents(tmp_path: Path) -> None:
    results = read_results(_mutants(tmp_path / "mutants"))
    assert len(results) == 8
    eq = ["bidir_kv.policy.blocks.x_cdiv__mutmut_4"]
    (row,) = score(results, ["bidir_kv.policy"], eq).values()
    assert row.killed == 3  # two failed tests and one timeout
    assert row.survived == ["bidir_kv.policy.blocks.x_cdiv__mutmut_3"]
    assert row.no_tests == ["bidir_kv.policy.blocks.x_cdiv__mutmut_5"]
    assert row.equivalent == eq and row.not_run == 1
    assert row.score == 3 / 5  # the protocol mutant is not in this scope


def test_the_gate_fails_below_the_floor_and_writes_the_survivors(tmp_path: Path) -> None:
    mutants, out = _mutants(tmp_path / "mutants"), tmp_path / "out"
    eq = tmp_path / "eq.txt"
    eq.write_text("# name  why\nbidir_kv.policy.blocks.x_cdiv__mutmut_4  same value either way\n")
    base = [
        "--mutants",
        str(mutants),
        "--scope",
        "bidir_kv.policy",
        "--out",
        str(out),
        "--equivalents",
        str(eq),
    ]
    assert main([*base, "--floor", "0.6"]) == 0
    assert main([*base, "--floor", "0.61"]) == 1
    report = (out / "survivors.md").read_text()
    assert "x_cdiv__mutmut_3 (survived)" in report and "same value either way" in report
    (pkg,) = json.loads((out / "score.json").read_text())["packages"]
    assert pkg["score"] == 0.6 and pkg["equivalent"] == 1
    assert main([*base, "--scope", "bidir_kv.router", "--floor", "0"]) == 2  # nothing ran
