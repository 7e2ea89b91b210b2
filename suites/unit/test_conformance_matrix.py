"""The conformance matrix (issue 5, deliverable 6) from a real inner pytest run.

The inner session loads only the conformance plugin and runs scenario-shaped tests
under ``suites/conformance/``, so the matrix code sees what a real run gives it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

SCENARIOS = """
import pytest
from pathlib import Path

def test_passes() -> None:
    pass

def test_documents(record_property) -> None:
    record_property("documented", "the route answers 404 here")

def test_fails() -> None:
    assert 1 == 2, "wrong answer"

@pytest.mark.skip(reason="no deployment given")
def test_skipped() -> None:
    pass

def test_fails_in_teardown(broken_teardown: None) -> None:
    pass

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("pair did not stop")
"""


def test_matrix_tells_each_outcome_with_its_reason(
    pytester: pytest.Pytester,
) -> None:
    pytester.mkdir("suites")
    pytester.mkdir("suites/conformance")
    (pytester.path / "suites" / "conformance" / "test_shapes.py").write_text(SCENARIOS)
    out = pytester.path / "report"
    result = pytester.runpytest_inprocess(
        "-p",
        "bidir_kv.testing.conformance",
        "--conformance-report",
        str(out),
        "suites/conformance",
    )
    outcomes = result.parseoutcomes()
    assert {k: outcomes.get(k) for k in ("passed", "failed", "skipped", "errors")} == {
        "passed": 3,
        "failed": 1,
        "skipped": 1,
        "errors": 1,
    }

    rows = {r["scenario"]: r for r in json.loads((out / "matrix.json").read_text())["results"]}
    assert (rows["test_passes"]["outcome"], rows["test_passes"]["reason"]) == ("passed", "")
    assert (rows["test_documents"]["outcome"], rows["test_documents"]["reason"]) == (
        "passed",
        "the route answers 404 here",
    )
    assert rows["test_fails"]["outcome"] == "fail"
    assert "wrong answer" in rows["test_fails"]["reason"]
    assert (rows["test_skipped"]["outcome"], rows["test_skipped"]["reason"]) == (
        "skip",
        "no deployment given",
    )
    broken = rows["test_fails_in_teardown"]
    assert broken["outcome"] == "error" and "pair did not stop" in broken["reason"]

    md = Path(out / "matrix.md").read_text()
    assert "| test_fails | - | direct | fail [" in md
    assert "| test_fails_in_teardown | - | direct | error [" in md
    assert "wrong answer" in md
    assert "| test_documents | - | direct | passed [" in md
    assert "on **-** (passed): the route answers 404 here" in md
