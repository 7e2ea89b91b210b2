"""The baseline gate (bidir_kv/testing/hw_baseline.py) on stored runs in pytest-benchmark's
file layout: it passes against itself and fails on a planted regression."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.testing.hw_baseline import DropCheck, gate_baseline, load_baseline
from bidir_kv.testing.hw_gates import GateFailure, LengthResult


def _result(length: int, off: float, on: float) -> LengthResult:
    return LengthResult(
        history_tokens=length,
        prompt_tokens=length + 182,
        off_s=[off, off * 1.01, off * 0.99],
        on_s=[on, on * 1.02, on * 0.98],
    )


def _store(storage: Path, name: str, results: list[LengthResult]) -> None:
    """One run as pytest-benchmark saves it (``<machine>/<NNNN>_<name>.json``)."""
    runs = sorted(storage.glob("*/*.json"))
    path = storage / "Linux-CPython-3.11-64bit" / f"{len(runs) + 1:04d}_{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    benches = [
        {
            "name": f"test_off_vs_on[{r.history_tokens}]",
            "fullname": f"suites/hardware/test_release_gate.py::test_off_vs_on[{r.history_tokens}]",
            "stats": {"min": 0.1, "max": 0.3, "mean": 0.2, "median": 0.2, "rounds": 3},
            "extra_info": r.to_dict(),
        }
        for r in results
    ]
    path.write_text(
        json.dumps({"machine_info": {"bidir_kv": {"kind": "vllm-cpu"}}, "benchmarks": benches})
    )


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    s = tmp_path / "benchmarks"
    _store(s, "release", [_result(2000, 0.40, 0.20), _result(8000, 1.6, 0.40)])
    return s


def test_a_run_passes_against_itself(storage: Path) -> None:
    base = load_baseline(str(storage), "0001")
    assert base.deployment == {"kind": "vllm-cpu"} and sorted(base.lengths) == [2000, 8000]
    for length, off, on in ((2000, 0.40, 0.20), (8000, 1.6, 0.40)):
        shown = gate_baseline(length, _result(length, off, on), base, 10.0)
        assert "speedup 2.000x vs 2.000x" in shown or "speedup 4.000x vs 4.000x" in shown


def test_a_planted_regression_fails_naming_length_and_field(storage: Path) -> None:
    base = load_baseline(str(storage), "release")
    slower_on = _result(8000, 1.6, 0.40 * 1.25)  # readback off: ON slower, speedup lower
    with pytest.raises(GateFailure) as failure:
        gate_baseline(8000, slower_on, base, 10.0)
    text = str(failure.value)
    assert text.startswith("length 8000: regression beyond 10 %: ON TTFT median rose 25.0 %")
    assert "ON TTFT median rose 25.0 %; speedup fell 20.0 %: ON median" in text
    assert "0001_release.json" in text
    # within the allowed percentage: passes
    gate_baseline(8000, _result(8000, 1.6, 0.40 * 1.05), base, 10.0)


def test_speedup_drop_alone_fails() -> None:
    assert DropCheck("speedup", 10).fails({"speedup": 1.7}, {"speedup": 2.0})
    assert not DropCheck("speedup", 10).fails({"speedup": 1.85}, {"speedup": 2.0})


def test_missing_run_or_length_is_named(storage: Path) -> None:
    with pytest.raises(pytest.UsageError, match=r"--hw-baseline 0042: no stored run matches"):
        load_baseline(str(storage), "0042")
    base = load_baseline(str(storage), "0001")
    with pytest.raises(
        GateFailure,
        match=r"length 4000: baseline .* has no rounds at this "
        r"length \(it has \[2000, 8000\]\)",
    ):
        gate_baseline(4000, _result(4000, 1, 0.5), base, 10.0)


def test_the_newest_of_several_matching_runs_is_the_baseline(storage: Path) -> None:
    """Runs saved under one name (a release stored each week) are compared against the
    newest: the fixture's 0001_release is 2.0x at 2000 tokens, 0003_release 2.5x."""
    _store(storage, "candidate", [_result(2000, 0.40, 0.40)])
    _store(storage, "release", [_result(2000, 0.50, 0.20)])
    base = load_baseline(str(storage), "release")
    assert base.source.endswith("0003_release.json"), base.source
    assert base.lengths[2000]["speedup"] == pytest.approx(2.5)
    # a candidate as good as the old release but 20 % behind the newest one fails
    with pytest.raises(GateFailure, match=r"speedup fell 20.0 %.*0003_release.json"):
        gate_baseline(2000, _result(2000, 0.40, 0.20), base, 10.0)
    # a glob over every run: still the newest (0003), not the oldest
    assert load_baseline(str(storage), "*").source.endswith("0003_release.json")


def test_a_stored_run_with_missing_parts_reads_what_it_has() -> None:
    """A run stored without the deployment, a benchmark that is no OFF/ON length (any
    order), a length stored before prompt_tokens was recorded."""
    from bidir_kv.testing.hw_baseline import Baseline

    assert Baseline("empty.json", {}).deployment == {} and Baseline("empty.json", {}).lengths == {}
    assert Baseline("x", {"machine_info": {"node": "n"}}).deployment == {}
    ok = _result(2000, 0.40, 0.20).to_dict()
    old = {k: v for k, v in _result(8000, 1.6, 0.40).to_dict().items() if k != "prompt_tokens"}
    benches = [
        {"name": "test_other"},  # no extra_info at all
        {"extra_info": {"history_tokens": 4000, "on_s": [0.1]}},  # ON rounds only
        {"extra_info": {"history_tokens": 4000, "off_s": [0.1]}},  # OFF rounds only
        {"extra_info": {"on_s": [0.1], "off_s": [0.2]}},  # no length
        {"extra_info": ok},
        {"extra_info": old},
    ]
    base = Baseline("run.json", {"benchmarks": benches})
    assert sorted(base.lengths) == [2000, 8000]
    assert base.lengths[8000]["speedup"] == pytest.approx(4.0)


def test_a_baseline_speedup_of_zero_makes_any_drop_infinite() -> None:
    assert DropCheck("speedup", 10).compute({"speedup": 1.0}, {"speedup": 0.0}) == float("inf")


def test_a_corrupt_stored_run_is_skipped_with_a_warning(
    storage: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (storage / "Linux-CPython-3.11-64bit" / "0002_release.json").write_text("{not json")
    base = load_baseline(str(storage), "release")  # the good 0001 is found
    assert base.source.endswith("0001_release.json")
    assert "0002_release.json" in caplog.text


def test_the_baseline_messages_in_full(storage: Path, tmp_path: Path) -> None:
    with pytest.raises(pytest.UsageError) as none:
        load_baseline(str(storage), "0042")
    assert str(none.value) == (
        f"--hw-baseline 0042: no stored run matches in {storage} (runs are stored with "
        "--benchmark-autosave or --benchmark-save)"
    )
    empty = tmp_path / "empty"
    _store(empty, "nothing", [])
    with pytest.raises(GateFailure) as lengthless:
        gate_baseline(2000, _result(2000, 0.4, 0.2), load_baseline(str(empty), "nothing"), 10.0)
    assert str(lengthless.value).endswith("has no rounds at this length (it has none)")
    base = load_baseline(str(storage), "release")
    shown = gate_baseline(2000, _result(2000, 0.40, 0.20), base, 10.0)
    assert shown == (
        "ON median 200.0 ms vs 200.0 ms, speedup 2.000x vs 2.000x "
        "(baseline Linux-CPython-3.11-64bit/0001_release.json)"
    )


def test_every_stored_run_carries_its_deployment() -> None:
    """pytest-benchmark's machine-info hook stores the deployment's summary with each run
    (what --hw-baseline compares against): these fields, none other."""
    from bidir_kv.testing.hardware import deployment_info
    from bidir_kv.testing.hw_baseline import pytest_benchmark_update_machine_info

    class _Config:
        stash = pytest.Stash()

    config: Any = _Config()
    deployment_info(config).update(
        {"kind": "vllm-cpu", "model": "tiny", "vllm": "0.32.0", "hosts": 2, "pids": [1, 2]}
    )
    machine_info: dict[str, Any] = {"node": "ci-runner"}
    pytest_benchmark_update_machine_info(config, machine_info)
    assert machine_info == {
        "node": "ci-runner",
        "bidir_kv": {
            "kind": "vllm-cpu",
            "model": "tiny",
            "vllm": "0.32.0",
            "nixl": None,
            "backend": None,
            "launcher": None,
            "hosts": 2,
            "block_size": None,
            "kv_bytes_per_token": None,
        },
    }
