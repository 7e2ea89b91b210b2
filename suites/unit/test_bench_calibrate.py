"""Calibration fits: synthetic runs with known terms must give those terms back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bidir_kv.bench.results import load_result
from bidir_kv.bench.runner import point_name
from bidir_kv.bench.stats import RequestRecord, write_records
from bidir_kv.plan.calibrate import CheckRow, calibrate, check_rows
from bidir_kv.plan.calprofile import write_profile
from bidir_kv.plan.cli import main as plan_main
from bidir_kv.plan.fit import fit_pull, least_squares, linear_fit
from bidir_kv.plan.planner import break_even_tokens

# the terms a synthetic run is generated from
RECOMPUTE_US, REQ_FIXED_US = 50.0, 3000.0
PULL_FIXED_US, PER_DESC_US, US_PER_BYTE, STEP_US = 800.0, 0.7, 0.002, 4000.0
POINTS = (1000, 3000, 6000)
REQUESTS, NEW = 6, 150


def _pairs(a: list[float], b: list[float]) -> list[tuple[float, float]]:
    return list(zip(a, b, strict=True))


def test_least_squares_solves_and_refuses_singular() -> None:
    coef = least_squares([[1, 0], [1, 1], [1, 2]], [1, 3, 5])
    assert coef == pytest.approx([1.0, 2.0])
    assert least_squares([[1, 2], [2, 4], [3, 6]], [1, 2, 3]) is None


def test_a_weighted_line_follows_the_heavier_points() -> None:
    xs, ys = [1.0, 2.0, 3.0], [10.0, 20.0, 60.0]
    assert linear_fit(xs, ys, [1.0, 1.0, 0.0]) == pytest.approx((0.0, 10.0), abs=1e-9)
    assert linear_fit(xs, ys) != pytest.approx((0.0, 10.0), abs=1e-3)


def test_pull_fit_separates_descriptors_from_bytes_when_the_run_allows() -> None:
    descs = [100.0, 400.0, 900.0]
    nbytes = [1e6, 2e6, 9e6]  # bytes per descriptor 10,000 / 5,000 / 10,000
    times = [PULL_FIXED_US + PER_DESC_US * d + US_PER_BYTE * b for d, b in _pairs(descs, nbytes)]
    fit = fit_pull(times, descs, nbytes)
    assert fit.separable
    assert fit.fixed_us == pytest.approx(PULL_FIXED_US)
    assert fit.per_descriptor_us == pytest.approx(PER_DESC_US)
    assert fit.us_per_byte == pytest.approx(US_PER_BYTE)


def test_pull_fit_folds_descriptors_when_bytes_per_descriptor_are_constant() -> None:
    descs = [100.0, 300.0, 600.0]
    nbytes = [d * 4096 for d in descs]
    times = [PULL_FIXED_US + PER_DESC_US * d + US_PER_BYTE * b for d, b in _pairs(descs, nbytes)]
    fit = fit_pull(times, descs, nbytes)
    assert not fit.separable and fit.per_descriptor_us == 0
    assert fit.fixed_us == pytest.approx(PULL_FIXED_US)
    assert fit.us_per_byte == pytest.approx(US_PER_BYTE + PER_DESC_US / 4096)
    assert "not separable" in fit.note and "constant" in fit.note


def _rec(leg: str, point: int, turn: int, conv: int, clients: int = 1) -> RequestRecord:
    # one client: every request alone (1 s apart, far longer than any prefill here);
    # two: each conversation on its own client, both turns arriving together
    start_s = turn if clients == 2 else conv * 3 + turn
    return RequestRecord(
        ttft_ms=10.0,
        tpot_ms=2.5,
        latency_ms=50.0,
        start_time_ms=start_s * 1000.0,
        input_num_turns=2 * turn - 1,
        input_num_tokens=point + NEW,
        output_num_tokens=8,
        output_num_chunks=8,
        output_num_first_chunk_tokens=1,
        approx_cached_percent=90.0,
        conversation_id=f"c{conv}",
        client_id=conv if clients == 2 else 0,
        leg=leg,
        point=point,
        turn=turn,
    )


def make_run(root: Path, step_us: float = STEP_US, clients: int = 1) -> Path:
    """OFF recomputes every prompt; ON pulls `point` tokens on every request and computes NEW.

    Bytes per descriptor differ between points (NIXL merges contiguous descriptors),
    so all three pull terms are identifiable. Two clients: the two requests of a
    turn arrive together and one of them waits for the other's compute on P.
    """
    out = root / "run"
    for leg in ("off", "on"):
        (out / leg).mkdir(parents=True)
        for i, point in enumerate(POINTS):
            recs = [_rec(leg, point, t, c, clients) for c in range(2) for t in (1, 2, 3)]
            write_records(out / leg / f"{point_name(point)}.stats.json", recs)
            prompt = point + NEW
            computed = prompt if leg == "off" else NEW
            per_req = REQ_FIXED_US + RECOMPUTE_US * computed
            if clients == 2:  # one request of each pair waits for the other's compute
                per_req += RECOMPUTE_US * computed / 2
            rows: dict[str, list] = {
                "prefill0": [
                    [
                        "vllm:prompt_tokens_by_source_total",
                        {"source": "local_compute"},
                        REQUESTS * computed,
                    ],
                ]
            }
            if leg == "on":
                nbytes, descs = point * 64.0, point / 16 * (2 + i)
                xfer = PULL_FIXED_US + PER_DESC_US * descs + US_PER_BYTE * nbytes
                # step_us < 0: residuals with a negative intercept and a negative
                # through-the-origin slope (what a noisy real run gave)
                per_req += xfer + (step_us / 2 if step_us >= 0 else (-30e3, -20e3, 1e3)[i])
                rows["prefill0"] += [
                    ["vllm:nixl_xfer_time_seconds_sum", {}, REQUESTS * xfer * 1e-6],
                    ["vllm:nixl_xfer_time_seconds_count", {}, REQUESTS],
                    ["vllm:nixl_bytes_transferred_sum", {}, REQUESTS * nbytes],
                    ["vllm:nixl_num_descriptors_sum", {}, REQUESTS * descs],
                    [
                        "vllm:prompt_tokens_by_source_total",
                        {"source": "external_kv_transfer"},
                        REQUESTS * point,
                    ],
                ]
            rows["router0"] = [
                [
                    "bidir_kv_router_prefill_duration_seconds_sum",
                    {"outcome": "ok"},
                    REQUESTS * per_req * 1e-6,
                ],
                ["bidir_kv_router_prefill_duration_seconds_count", {"outcome": "ok"}, REQUESTS],
            ]
            info = {"duration_s": 1.0, "metrics_delta": rows}
            (out / leg / f"{point_name(point)}.metrics.json").write_text(json.dumps(info))
    manifest = {
        "topology": "emulator",
        "profile": "tiny",
        "num_clients": clients,
        "engines": {"block_size": 16},
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_calibration_recovers_every_term(tmp_path: Path) -> None:
    result = load_result(make_run(tmp_path))
    cost = calibrate(result)
    assert cost.recompute_us_per_token == pytest.approx(RECOMPUTE_US)
    assert cost.prefill_fixed_us == pytest.approx(REQ_FIXED_US)
    assert cost.pull_overhead_us == pytest.approx(PULL_FIXED_US)
    assert cost.xfer_us_per_descriptor == pytest.approx(PER_DESC_US)
    assert cost.xfer_us_per_token == pytest.approx(US_PER_BYTE * 64)
    assert cost.kv_bytes_per_token == pytest.approx(64.0)
    assert cost.step_us == pytest.approx(STEP_US)
    # the calibration predicts its own run exactly when the run follows the model
    for row in check_rows(result, cost):
        assert CheckRow.error(row.off_ms, row.off_pred_ms) == pytest.approx(0, abs=1e-9)
        assert CheckRow.error(row.on_ms, row.on_pred_ms) == pytest.approx(0, abs=0.02)
    assert break_even_tokens(cost) > 0


def test_two_clients_on_one_p_are_a_contention_wait_not_a_dearer_token(tmp_path: Path) -> None:
    """Pairs arriving together: the fit takes the wait out and recovers the per-request terms."""
    result = load_result(make_run(tmp_path, clients=2))
    cost = calibrate(result)
    assert cost.recompute_us_per_token == pytest.approx(RECOMPUTE_US, rel=1e-4)
    assert cost.prefill_fixed_us == pytest.approx(REQ_FIXED_US, rel=1e-3)
    assert cost.step_us == pytest.approx(STEP_US, rel=1e-3)
    assert any("contention (2 client(s)" in n for n in cost.notes)
    for row, point in zip(check_rows(result, cost), POINTS, strict=True):
        assert row.off_wait_ms * 1e3 == pytest.approx(RECOMPUTE_US * (point + NEW) / 2, rel=1e-3)
        assert CheckRow.error(row.off_ms, row.off_pred_ms) == pytest.approx(0, abs=1e-3)
        assert CheckRow.error(row.on_ms, row.on_pred_ms) == pytest.approx(0, abs=0.02)


def test_calibration_becomes_a_loadable_profile(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    prof = write_profile(run, tmp_path / "mine.json")
    assert prof.name == "mine" and prof.sources
    assert prof.prefill_seconds(1000) == pytest.approx(RECOMPUTE_US * 1000 * 1e-6)
    assert prof.step_us == pytest.approx(STEP_US)
    # the profile's pull is the fitted pull (bytes at the run's 64 B/token)
    cost = calibrate(load_result(run))
    n = 1600
    assert prof.transfer_seconds(n) * 1e6 + prof.step_us / 2 == pytest.approx(
        cost.pull_us(n), rel=0.02
    )


def test_plan_prints_the_check_against_the_run(tmp_path: Path, capsys) -> None:
    assert plan_main(["--calibration", str(make_run(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "Calibration against its own run" in out
    assert "per-descriptor" in out or "fixed, per-descriptor and per-byte" in out


def test_an_on_leg_faster_than_the_model_gives_no_negative_term(tmp_path: Path) -> None:
    """Noise can make ON prefill shorter than transfer + tail: the terms stay >= 0."""
    cost = calibrate(load_result(make_run(tmp_path, step_us=-20_000.0)))
    assert cost.step_us == 0 and cost.pull_after_us_per_token == 0
    assert write_profile(make_run(tmp_path / "again", step_us=-20_000.0), tmp_path / "p.json")
