"""The hardware tier's gates as functions: each passes on good rounds and fails, naming
length, bound and measurement, on bad ones."""

from __future__ import annotations

import pytest

from bidir_kv.testing.hw_gates import (
    GateFailure,
    LengthResult,
    bound_for,
    calibrated_bounds,
    gate_efficiency,
    gate_mechanism,
    gate_speedup,
    parse_bounds,
)

BLOCK, PER_TOKEN = 128, 2048.0


def _result(
    history: int, off_ms: float, on_ms: float, pulled: int | None = None, rounds: int = 3
) -> LengthResult:
    pulled = history + 31 if pulled is None else pulled
    slots = -(-pulled // BLOCK) * BLOCK
    return LengthResult(
        history_tokens=history,
        prompt_tokens=history + 32 + 150,
        off_s=[off_ms / 1e3] * rounds,
        on_s=[on_ms / 1e3] * rounds,
        pulled_tokens=[pulled] * rounds,
        bytes_moved=[slots * PER_TOKEN] * rounds,
        xfer_s=[0.002] * rounds,
        xfers=[1] * rounds,
    )


def test_speedup_gate_passes_and_fails_naming_length_bound_measurement() -> None:
    res = _result(3000, off_ms=300, on_ms=100)
    assert gate_speedup(res, 2.5) == pytest.approx(3.0)
    with pytest.raises(GateFailure) as exc:
        gate_speedup(res, 3.5, "--hw-min-speedup")
    text = str(exc.value)
    assert "length 3000" in text and "3.500x" in text and "3.000x" in text
    assert "--hw-min-speedup" in text


def test_mechanism_gate() -> None:
    gate_mechanism(_result(1000, 10, 5), BLOCK, PER_TOKEN)
    gate_mechanism(_result(1000, 10, 5), BLOCK, None)  # shape unknown: rounds agree
    with pytest.raises(GateFailure, match="length 1000: an ON round pulled 0 tokens"):
        gate_mechanism(_result(1000, 10, 5, pulled=0), BLOCK, PER_TOKEN)
    short = _result(1000, 10, 5)
    short.bytes_moved[1] *= 0.98  # 2 % fewer bytes than the blocks hold
    with pytest.raises(GateFailure, match="within 1%"):
        gate_mechanism(short, BLOCK, PER_TOKEN)
    assert gate_mechanism(_result(1000, 10, 5), BLOCK, PER_TOKEN * 1.005) is None  # inside 1 %
    with pytest.raises(GateFailure, match="within 1%"):
        gate_mechanism(_result(1000, 10, 5), BLOCK, PER_TOKEN * 1.02)
    failed = _result(1000, 10, 5)
    failed.failed = 1
    with pytest.raises(GateFailure, match="length 1000: 1 failed KV transfers"):
        gate_mechanism(failed, BLOCK, PER_TOKEN)
    lapsed = _result(1000, 10, 5)
    lapsed.expired = 1  # an earlier turn's P lease lapsed during an ON round that pulled
    assert gate_mechanism(lapsed, BLOCK, PER_TOKEN) is None


def test_efficiency_gate() -> None:
    res = _result(3000, 10, 5)  # 3072 slots × 2 KiB in 2 ms each: ~25 Gb/s
    assert gate_efficiency(res, 40.0, 0.5) == pytest.approx(res.gbps)
    with pytest.raises(GateFailure, match=r"length 3000: transfer rate .* below the bound 50.00"):
        gate_efficiency(res, 100.0, 0.5)


def test_bounds_parse_and_refuse_bad_items() -> None:
    assert parse_bounds("4096=1.3, 16384=2") == {4096: 1.3, 16384: 2.0}
    assert parse_bounds(None) == {}
    with pytest.raises(ValueError, match="'4096'"):
        parse_bounds("4096")


def test_calibrated_bound_follows_the_runs_own_cost_lines() -> None:
    # OFF grows 0.1 ms/token over a 5 ms fixed cost; ON's pull is cheap: speedup grows.
    rows = [_result(n, off_ms=5 + 0.1 * (n + 182), on_ms=5 + 0.1 * 182 + 1) for n in (1000, 3000)]
    bounds = calibrated_bounds(
        rows, threshold=64, block_size=BLOCK, tolerance=0.3, kv_bytes_per_token=PER_TOKEN
    )
    for r in rows:
        bound, predicted = bounds[r.history_tokens]
        assert bound == pytest.approx(predicted * 0.7)
        assert predicted > 1.0
        gate_speedup(r, bound)  # the run meets its own calibrated bound
    assert bounds[3000][1] > bounds[1000][1]
    bound, source = bound_for(1000, {}, bounds, 0.3)
    assert "calibrated" in source and bound == bounds[1000][0]
    assert bound_for(1000, {1000: 9.0}, bounds, 0.3) == (9.0, "--hw-min-speedup")
    # a length whose readback is as slow as recompute fails its calibrated bound
    slow = _result(3000, off_ms=rows[1].off_s[0] * 1e3, on_ms=rows[1].off_s[0] * 1e3)
    with pytest.raises(GateFailure, match="length 3000"):
        gate_speedup(slow, bounds[3000][0], "calibrated")


def test_a_length_off_the_runs_own_lines_fails_its_calibrated_bound() -> None:
    def on_ms(n: int) -> float:
        return 20 + 0.005 * (n + 31)  # a cheap pull, linear in what is pulled

    rows = [_result(n, off_ms=5 + 0.1 * (n + 182), on_ms=on_ms(n)) for n in (1000, 2000, 3000)]
    rows[1].on_s = [t * 4 for t in rows[1].on_s]  # 2000 reads back 4x slower than the line
    bounds = calibrated_bounds(rows, threshold=64, block_size=BLOCK, tolerance=0.3)
    gate_speedup(rows[0], bounds[1000][0])
    gate_speedup(rows[2], bounds[3000][0])
    with pytest.raises(GateFailure, match="length 2000"):
        gate_speedup(rows[1], bounds[2000][0], "calibrated")


def test_decode_gate_bounds_tpot_p99_on_over_off() -> None:
    """TPOT p99 ON vs OFF (issue 33): within the bound passes and says what it compared;
    beyond it fails naming where, both p99s and the bound; nothing to compare fails."""
    from bidir_kv.testing.hw_gates import gate_tpot

    off = [0.004] * 99 + [0.005]
    ok = gate_tpot("length 2000", off, [x * 1.1 for x in off], 20.0)
    assert "+10.0 %" in ok and "100 ON and 100 OFF turns" in ok
    with pytest.raises(GateFailure) as exc:
        gate_tpot("length 2000", off, [x * 1.5 for x in off], 20.0)
    msg = str(exc.value)
    assert msg.startswith("length 2000: decode regression beyond 20 %")
    assert "ON 6.02 ms vs OFF 4.01 ms (+50.0 %" in msg  # p99 of 99 x 4 ms and one 5 ms
    # a faster ON passes; an empty side is a failure, not a pass
    assert "-50.0 %" in gate_tpot("p", off, [x / 2 for x in off], 0.0)
    with pytest.raises(GateFailure, match="no TPOT to compare"):
        gate_tpot("p", off, [], 20.0)
