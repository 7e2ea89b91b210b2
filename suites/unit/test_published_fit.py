"""One fit, two inputs: a published table is calibrated by the fit behind
``plan --calibration``; the shipped qwen3-32b-p5en profile is that fit of the issue's
figures, with its residuals; the demo prints the published figure beside its own.

Why (issue 24): the first-principles profile missed the one measurement of this
deployment by up to 2.3×; the published table is the calibration, and the terms it
gives must be reproducible from the table alone (no hand tuning, no invented points).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bidir_kv.bench.results import load_result
from bidir_kv.engine.profiles import load_profile
from bidir_kv.plan.calibrate import calibrate, fit, fit_input, residuals
from bidir_kv.plan.contention import closed_loop_wait_us
from bidir_kv.plan.derive import calibrated_cost, calibrated_input, predicted_cost
from bidir_kv.plan.planner import CostModel, break_even_tokens
from bidir_kv.plan.published import PublishedTable, load_table
from bidir_kv.plan.published import fit_input as table_input
from bidir_kv.report.demo import min_turn, published_lines

# the figures issue 24 states (ms), and nothing else
ISSUE_FIGURES = {
    2000: {
        "ttft_off": 158,
        "ttft_on": 122,
        "prefill_off": 153,
        "prefill_on": 128,
        "kv_transfer": 30,
    },
    24000: {
        "ttft_off": 778,
        "ttft_on": 460,
        "prefill_off": 744,
        "prefill_on": 414,
        "kv_transfer": 130,
    },
}


def _table(figures: dict[int, dict[str, float]]) -> PublishedTable:
    shipped = load_table("qwen3-32b-p5en")
    assert shipped is not None
    return replace(shipped, figures_ms=figures)


def _figures_of(cost: CostModel, table: PublishedTable, points: list[int]) -> dict:
    """What a deployment following ``cost`` exactly would publish for ``table``'s workload."""
    out = {}
    for p in points:
        prompt, pulled = table.mean_prompt_tokens(p), table.mean_pulled_tokens(p)
        off = cost.prefill_fixed_us + cost.recompute_us(prompt)
        xfer = cost.pull_overhead_us + pulled * cost.xfer_us_per_token
        on = (
            cost.prefill_fixed_us
            + cost.recompute_us(prompt - pulled, pulled)
            + xfer
            + cost.step_us / 2
            + pulled * cost.pull_after_us_per_token
        )
        part = cost.decode_ttft_us(prompt)
        out[p] = {
            "prefill_off": off / 1e3,
            "prefill_on": on / 1e3,
            "kv_transfer": xfer / 1e3,
            "ttft_off": (off + part) / 1e3,
            "ttft_on": (on + part) / 1e3,
        }
    return out


def test_the_shipped_table_holds_only_the_issues_figures() -> None:
    table = load_table("qwen3-32b-p5en")
    assert table is not None and table.figures_ms == ISSUE_FIGURES
    assert load_table("glm5-fp8-p5en") is None  # predicted: no table to fit
    assert load_table("bidir_kv/data/profiles/qwen3-32b-p5en.json") == table  # by path too


def test_the_tables_workload_gives_the_tokens_per_point() -> None:
    """10 turns, 20 % warm-up: turns 3..10; turn t sends prefix + 150 + (t-1) x 450."""
    table = load_table("qwen3-32b-p5en")
    assert table is not None
    assert list(table.measured_turns()) == list(range(2, 10))
    assert table.mean_prompt_tokens(2000) == 2000 + 150 + 450 * 5.5
    # D holds the previous prompt and answer but its last token; P pulls its whole blocks
    assert table.pulled_tokens(2000, 2) == (2000 + 150 + 450 + 300 - 1) // 16 * 16
    assert table.pulled_tokens(2000, 0) == 0


def test_the_fit_recovers_known_terms_from_a_table() -> None:
    """A table generated from known terms gives those terms back (at three lengths the
    ON residual's intercept, half a step, is identifiable too)."""
    truth = CostModel(
        recompute_us_per_token=20.0,
        recompute_us_per_token_ctx=20.0 * 0.0328,
        xfer_us_per_token=5.0,
        pull_overhead_us=8000.0,
        kv_bytes_per_token=262_144.0,
        prefill_fixed_us=50_000.0,
        step_us=4000.0,
        pull_after_us_per_token=6.0,
        decode_ttft_fixed_us=3000.0,
        decode_ttft_us_per_token=1.5,
    )
    table = _table({})
    table = replace(table, figures_ms=_figures_of(truth, table, [2000, 12000, 24000]))
    inp = table_input(table)
    got = fit(replace(inp, ctx_ratio=0.0328))
    assert got.recompute_us_per_token == pytest.approx(20.0, rel=1e-6)
    assert got.recompute_us_per_token_ctx == pytest.approx(20.0 * 0.0328, rel=1e-6)
    assert got.prefill_fixed_us == pytest.approx(50_000.0, rel=1e-6)
    assert got.pull_overhead_us == pytest.approx(8000.0, rel=1e-6)
    assert got.xfer_us_per_token == pytest.approx(5.0, rel=1e-6)
    assert got.step_us == pytest.approx(4000.0, rel=1e-4)
    assert got.pull_after_us_per_token == pytest.approx(6.0, rel=1e-4)
    assert got.decode_ttft_fixed_us == pytest.approx(3000.0, rel=1e-4)
    assert got.decode_ttft_us_per_token == pytest.approx(1.5, rel=1e-4)
    assert all(abs(r.error) < 1e-6 for r in residuals(inp, got))


def test_the_fit_takes_the_clients_wait_out_of_a_table() -> None:
    """Two clients in closed loops wait for each other on P; a table's means hold that
    wait. Figures made by known terms plus the estimated wait give the terms back."""
    assert closed_loop_wait_us(500.0, 1500.0, 1) == 0.0
    w = closed_loop_wait_us(500.0, 1500.0, 2)
    assert w == pytest.approx(500.0**2 / (2 * (500.0 + w + 1500.0)))
    truth = CostModel(
        recompute_us_per_token=15.0,
        recompute_us_per_token_ctx=15.0 * 0.0328,
        xfer_us_per_token=4.5,
        pull_overhead_us=9000.0,
        kv_bytes_per_token=262_144.0,
        prefill_fixed_us=70_000.0,
        pull_after_us_per_token=6.5,
        decode_ttft_us_per_token=1.0,
    )
    table = _table({p: dict.fromkeys(ISSUE_FIGURES[2000], 1.0) for p in (2000, 24000)})
    blank = table_input(table, decode_us_per_token=3720.0)
    made: dict[int, dict[str, float]] = {p: {} for p in (2000, 24000)}
    names = {"prefill OFF": "prefill_off", "prefill ON": "prefill_on", "KV transfer": "kv_transfer"}
    for r in residuals(blank, truth):
        if r.figure in names:
            made[r.point][names[r.figure]] = r.fitted_us / 1e3
    for p, f in made.items():
        part = truth.decode_ttft_us(table.mean_prompt_tokens(p)) / 1e3
        f["ttft_off"], f["ttft_on"] = f["prefill_off"] + part, f["prefill_on"] + part
    inp = table_input(replace(table, figures_ms=made), decode_us_per_token=3720.0)
    assert inp.rest_us == 300 * 3720.0 and inp.closed_loop()
    got = fit(replace(inp, ctx_ratio=0.0328))
    assert got.recompute_us_per_token == pytest.approx(15.0, rel=1e-3)
    assert got.prefill_fixed_us == pytest.approx(70_000.0, rel=1e-3)
    assert got.pull_after_us_per_token == pytest.approx(6.5, rel=1e-2)
    # without the estimate the wait lands in the per-request terms
    plain = fit(replace(inp, ctx_ratio=0.0328, rest_us=0.0))
    assert plain.recompute_us_per_token > 15.0 * 1.05


def test_the_published_fit_and_its_residuals() -> None:
    """The issue's figures, fitted: every figure within 10 % of what the terms give back
    (the ON prefill and TTFT ON carry the rest: two points, more terms than points)."""
    _, cost = calibrated_cost()
    res = residuals(calibrated_input()[1], cost)
    assert len(res) == 10  # five figures at two lengths, none invented
    by = {(r.point, r.figure): r.error for r in res}
    for key in [(p, f) for p in (2000, 24000) for f in ("prefill OFF", "KV transfer")]:
        assert by[key] == pytest.approx(0, abs=1e-9), key  # two points, two terms: exact
    assert max(abs(e) for e in by.values()) < 0.10
    assert cost.prefill_fixed_us == pytest.approx(71_358, rel=1e-3)
    assert cost.recompute_us_per_token == pytest.approx(14.749, rel=1e-3)
    assert cost.pull_overhead_us == pytest.approx(9_700, rel=1e-3)
    assert cost.xfer_us_per_token == pytest.approx(4.5455, rel=1e-3)
    # the shipped profile is this fit, term by term
    prof = load_profile("qwen3-32b-p5en")
    assert prof.prefill_us_per_token == pytest.approx(cost.recompute_us_per_token, rel=1e-4)
    assert prof.prefill_fixed_us == pytest.approx(cost.prefill_fixed_us, rel=1e-4)
    assert prof.transfer_seconds(20_000) * 1e6 == pytest.approx(
        cost.pull_overhead_us + 20_000 * cost.xfer_us_per_token, rel=1e-4
    )
    assert prof.pull_after_us_per_token == pytest.approx(cost.pull_after_us_per_token, rel=1e-4)


def test_one_fit_two_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan --calibration DIR`` and the published table go through the same ``fit``."""
    from test_bench_calibrate import make_run  # the synthetic bench run of that suite

    import bidir_kv.plan.calibrate as calibrate_mod
    import bidir_kv.plan.derive as derive_mod

    result = load_result(make_run(tmp_path))
    assert calibrate(result) == fit(fit_input(result))
    seen: list[str] = []

    def spy(inp, kv=None):  # type: ignore[no-untyped-def]
        seen.append(inp.source)
        return fit(inp, kv)

    monkeypatch.setattr(calibrate_mod, "fit", spy)
    monkeypatch.setattr(derive_mod, "fit", spy)
    calibrate_mod.calibrate(result)
    derive_mod.calibrated_cost()
    assert [s.split()[0] for s in seen] == ["calibrated", "fitted"]


def test_glm5_is_predicted_not_fitted() -> None:
    """GLM-5-FP8: compute from its class's public measurements, the deployment terms
    carried from the Qwen3-32B fit; no GLM-5 figure of the publication is read."""
    _, qwen = calibrated_cost()
    glm = predicted_cost().cost
    assert load_table("glm5-fp8-p5en") is None
    assert glm.pull_overhead_us == qwen.pull_overhead_us
    assert glm.pull_after_us_per_token == qwen.pull_after_us_per_token
    assert glm.decode_ttft_us_per_token == qwen.decode_ttft_us_per_token
    # the per-request part scaled by layers (78 / 64), not the model's compute
    assert glm.prefill_fixed_us == pytest.approx(qwen.prefill_fixed_us * 78 / 64)
    # the split of the pull reproduces the fitted Qwen3-32B pull at its own layout
    pred = predicted_cost()
    qwen_pull = 8 * pred.per_descriptor_us + 32_768 / (pred.rail_gbytes_per_s * 1e3)
    assert qwen_pull == pytest.approx(qwen.xfer_us_per_token)
    assert 0 < break_even_tokens(glm) < 2000


def test_demo_prints_the_published_figure_beside_its_own() -> None:
    table = _table(ISSUE_FIGURES)
    measured = {
        2000: {
            "ttft_off": 170.0,
            "ttft_on": 120.0,
            "prefill_off": 153.0,
            "prefill_on": None,
            "kv_transfer": 40.0,
        },
        12000: {"ttft_off": 400.0},  # not in the table: not shown
    }
    lines = published_lines(table, measured)
    body = "\n".join(lines)
    assert "band ±15%" in lines[0]
    assert any(ln.split()[:3] == ["2000", "TTFT", "OFF"] and "+7.6%" in ln for ln in lines)
    kv = next(ln for ln in lines[2:] if "KV transfer" in ln)
    assert "+33.3%" in kv and "outside the band" in kv
    assert "n/a" in next(ln for ln in lines[2:] if "prefill ON" in ln)
    assert "12000" not in body and "24000" not in body
    none = published_lines(table, {8000: {"ttft_off": 1.0}})
    assert "none of the run's lengths" in none[-1]


def test_demo_warm_up_is_a_fifth_of_the_turns() -> None:
    assert min_turn(10, 0.2) == 3  # turns 3..10 measured, as the publication
    assert min_turn(4, 0.0) == 2  # turn 1 is a miss in both legs, never measured
