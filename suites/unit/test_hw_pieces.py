"""Pieces of the hardware tier that need no deployment: the --hw-launch node specs and
the tier's JUnit writer (the release gate script reads it), the measurement fixture."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import replace
from typing import Any

import pytest

from bidir_kv.serve.command import argv_value, build
from bidir_kv.testing.hw_launch import _spec
from bidir_kv.testing.hw_options import HwOptions
from bidir_kv.testing.hw_report import _junit


def test_launched_pair_follows_the_recipe_on_one_host() -> None:
    opts = HwOptions(launch=True, launch_model="Qwen/Qwen3-32B")
    opts = replace(opts, launch_arg=("--gpu-memory-utilization", "0.9"))
    p, d = (build(_spec(opts, role, "Qwen/Qwen3-32B")) for role in ("prefill", "decode"))
    assert "--no-enable-prefix-caching" in p.argv and "--no-enable-prefix-caching" not in d.argv
    assert p.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and d.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != d.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert argv_value(p.argv, "--port") == "8100" and argv_value(d.argv, "--port") == "8200"
    assert p.env["FI_PROVIDER"] == "efa" and "--gpu-memory-utilization" in d.argv
    kv = json.loads(str(argv_value(d.argv, "--kv-transfer-config")))
    assert kv["kv_connector_extra_config"]["backends"] == ["LIBFABRIC"] and kv["kv_rank"] == 1


def test_junit_counts_failures_and_skips() -> None:
    cases = [
        {
            "nodeid": "suites/hardware/t.py::test_a[1000]",
            "outcome": "passed",
            "duration": 1.0,
            "message": "",
        },
        {
            "nodeid": "suites/hardware/t.py::test_b",
            "outcome": "failed",
            "duration": 0.5,
            "message": "length 1000: below the bound <2.0x>",
        },
        {
            "nodeid": "suites/hardware/t.py::test_c",
            "outcome": "skipped",
            "duration": 0.0,
            "message": "",
        },
    ]
    root = ET.fromstring(_junit(cases))
    assert (root.get("tests"), root.get("failures"), root.get("skipped")) == ("3", "1", "1")
    failure = root.find("testcase[@name='test_b']/failure")
    assert failure is not None and "below the bound <2.0x>" in str(failure.get("message"))


def test_a_length_is_measured_once_by_whichever_test_asks_first(monkeypatch: Any) -> None:
    """The tier's session fixture: any test may ask first (so each runs alone and under
    xdist); later asks get the same rounds; another deployment is measured afresh."""
    from bidir_kv.testing import hardware
    from bidir_kv.testing.hw_gates import LengthResult

    calls: list[tuple[object, int, int]] = []

    def fake(dep: object, history: int, rounds: int, round_s: list[float]) -> LengthResult:
        calls.append((dep, history, rounds))
        round_s.extend([0.1] * rounds)
        return LengthResult(history_tokens=history, prompt_tokens=history + 150)

    monkeypatch.setattr(hardware, "measure_length", fake)
    measured = hardware.HwMeasurements(hardware.HwShape(1, 2, 1, rounds=3, answer_tokens=1))
    dep_a, dep_b = object(), object()
    gate_first = measured.length(dep_a, 2000)  # type: ignore[arg-type]
    assert measured.length(dep_a, 2000) is gate_first  # type: ignore[arg-type]
    every = measured.lengths(dep_a, [3000, 1000, 2000])  # type: ignore[arg-type]
    assert [r.history_tokens for r in every] == [1000, 2000, 3000] and every[1] is gate_first
    assert calls == [(dep_a, 2000, 3), (dep_a, 1000, 3), (dep_a, 3000, 3)]
    assert measured.round_s[1000] == [0.1, 0.1, 0.1]
    assert measured.length(dep_b, 2000) is not gate_first  # type: ignore[arg-type]
    assert calls[-1] == (dep_b, 2000, 3) and set(measured.results) == {2000}


def test_a_failed_measurement_is_not_repeated(monkeypatch: Any) -> None:
    """Gate tests after a failed measurement fail at once, naming the first error."""
    import pytest

    from bidir_kv.testing import hardware

    calls: list[int] = []

    def broken(dep: object, history: int, rounds: int, round_s: list[float]) -> Any:
        calls.append(history)
        raise AssertionError("turn 1 failed: HTTP 500")

    monkeypatch.setattr(hardware, "measure_length", broken)
    measured = hardware.HwMeasurements(hardware.HwShape(1, 2, 1, rounds=5, answer_tokens=1))
    dep = object()
    with pytest.raises(AssertionError, match="HTTP 500"):
        measured.length(dep, 1000)  # type: ignore[arg-type]
    with pytest.raises(
        pytest.fail.Exception,
        match="length 1000 could not be measured: AssertionError: turn 1 failed: HTTP 500",
    ):
        measured.length(dep, 1000)  # type: ignore[arg-type]
    assert calls == [1000]


# ---- where the dry run places P and D: never one host silently in CI -------------------


def test_the_dry_run_is_on_two_hosts_or_says_why_not() -> None:
    from bidir_kv.testing.hardware import TWO_HOSTS_PROVISION, dry_run_launcher

    assert dry_run_launcher(None, None, required=True) == "ssh"
    assert dry_run_launcher("auto", None, required=False) == "ssh"
    # asked for: as asked, whether or not two hosts could be made
    assert dry_run_launcher("local", "no sshd", required=True) == "local"
    # not required (a laptop): one host, the fabric gate skips and says so
    assert dry_run_launcher(None, "no sshd", required=False) == "local"
    # required (CI): a failure naming what is missing and the provisioning step
    with pytest.raises(pytest.fail.Exception) as err:
        dry_run_launcher(None, "/usr/sbin/sshd is not installed", required=True)
    msg = str(err.value)
    assert msg.startswith("hardware tier is required here but its dry run cannot have two hosts")
    assert "/usr/sbin/sshd is not installed" in msg and f"bash {TWO_HOSTS_PROVISION}" in msg
