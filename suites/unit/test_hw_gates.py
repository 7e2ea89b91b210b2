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


def test_speedup_gate_edges_and_its_whole_message() -> None:
    res = _result(3000, off_ms=500, on_ms=125)
    assert gate_speedup(res, 4.0) == 4.0  # exactly at the bound: passes
    with pytest.raises(GateFailure) as exc:
        gate_speedup(res, 4.5)
    assert str(exc.value) == (
        "length 3000: TTFT speedup 4.000x (OFF median 500.0 ms / ON median 125.0 ms) is "
        "below the bound 4.500x (given)"
    )
    for missing in ("off_s", "on_s"):
        half = _result(3000, off_ms=300, on_ms=100)
        setattr(half, missing, [])
        with pytest.raises(GateFailure) as none:
            gate_speedup(half, 1.0)
        assert str(none.value) == "length 3000: no OFF/ON rounds were measured"


def test_mechanism_gate_edges_and_its_whole_messages() -> None:
    one = _result(1000, 10, 5, pulled=1)  # a single pulled token is a pull
    assert gate_mechanism(one, BLOCK, PER_TOKEN) is None
    for pulled in ([], [1000, 0, 1000]):
        res = _result(1000, 10, 5)
        res.pulled_tokens = pulled
        with pytest.raises(GateFailure) as exc:
            gate_mechanism(res, BLOCK, PER_TOKEN)
        assert str(exc.value) == (
            "length 1000: an ON round pulled 0 tokens from D (bound: > 0); D->P readback "
            "did not engage"
        )
    short = _result(1000, 10, 5)
    short.bytes_moved[2] = 1000.0
    with pytest.raises(GateFailure) as bad:
        gate_mechanism(short, BLOCK, PER_TOKEN)
    assert str(bad.value) == (
        "length 1000: 1,000 bytes moved for 1031 pulled tokens; expected 2,359,296 "
        "(= 1152 block slots × 2,048 B/token) within 1%"
    )
    # model shape unknown: the first round sets the bytes per token, later rounds of
    # another length must agree with it
    mixed = _result(1000, 10, 5, rounds=2)
    mixed.pulled_tokens = [1000, 2000]
    mixed.bytes_moved = [1024 * 300.0, 2048 * 300.0]  # 8 and 16 blocks of 128 × 300 B
    assert gate_mechanism(mixed, BLOCK, None) is None
    mixed.bytes_moved[1] *= 1.05
    with pytest.raises(GateFailure, match="× 300 B/token"):
        gate_mechanism(mixed, BLOCK, None)
    uneven = _result(1000, 10, 5)
    uneven.bytes_moved.pop()  # a round with a pull count and no byte count
    with pytest.raises(ValueError):
        gate_mechanism(uneven, BLOCK, PER_TOKEN)


def test_efficiency_gate_edges_and_its_whole_messages() -> None:
    res = _result(3000, 10, 5)
    rate = res.gbps
    assert rate is not None and gate_efficiency(res, rate, 1.0) == rate  # at the bound
    res.xfer_s = [0.0] * 3
    with pytest.raises(GateFailure) as exc:
        gate_efficiency(res, 100.0, 0.5)
    assert str(exc.value) == (
        "length 3000: transfer rate no transfer time recorded is below the bound 50.00 Gb/s "
        "(50% of 100 Gb/s)"
    )
    slow = _result(3000, 10, 5)
    with pytest.raises(GateFailure) as low:
        gate_efficiency(slow, 100.0, 0.5)
    assert str(low.value) == (
        f"length 3000: transfer rate {slow.gbps:.2f} Gb/s is below the bound 50.00 Gb/s "
        "(50% of 100 Gb/s)"
    )


def test_bounds_skip_empty_items_anywhere() -> None:
    assert parse_bounds("4096=1.3,,16384=2,") == {4096: 1.3, 16384: 2.0}
    assert parse_bounds(" ,4096=1.3") == {4096: 1.3}


def test_a_stored_round_reads_back_whole() -> None:
    """What the hardware tier stores per length (pytest-benchmark's extra_info, read back
    by --hw-baseline and the report) holds every field under its own name."""
    res = _result(3000, 300, 100)
    res.failed, res.expired, res.fabric = 1, 2, [{"eth1 rx_bytes": 5}]
    stored = res.to_dict()
    assert stored["speedup"] == pytest.approx(3.0) and stored["gbps"] == res.gbps
    back = LengthResult(**{k: v for k, v in stored.items() if k not in ("speedup", "gbps")})
    assert back == res
    assert LengthResult(3000, 3182, off_s=[0.3]).to_dict()["speedup"] is None
    assert LengthResult(3000, 3182, on_s=[0.1]).to_dict()["speedup"] is None


def test_calibrated_bounds_reproduce_rounds_on_the_runs_own_lines() -> None:
    """Rounds exactly on straight lines (recompute 5 ms + 100 µs/token; a pull 2 ms +
    5 µs/token, then the unpulled tail recomputed): the prediction is each length's own
    measured speedup, and the bound is that less the tolerance."""

    def on_the_lines(n: int) -> LengthResult:
        prompt = n + 182
        off = (5000 + 100 * prompt) / 1e6
        on = (5000 + 2000 + 5 * n + 100 * (prompt - n)) / 1e6
        return LengthResult(n, prompt, [off] * 3, [on] * 3, [n] * 3, [n * 1e3] * 3)

    rows = [on_the_lines(n) for n in (1024, 2048, 4096)]
    bounds = calibrated_bounds(
        rows, threshold=64, block_size=BLOCK, tolerance=0.1, kv_bytes_per_token=1e3
    )
    for r in rows:
        bound, predicted = bounds[r.history_tokens]
        assert predicted == pytest.approx(r.speedup, rel=1e-9)
        assert bound == pytest.approx(r.speedup * 0.9, rel=1e-9)
    assert calibrated_bounds([], threshold=64, block_size=BLOCK, tolerance=0.1) == {}
    # a length whose ON rounds pulled nothing (readback did not engage; the mechanism
    # gate names it) is predicted as recomputed and leaves the others' bounds alone
    rows[1].pulled_tokens, rows[1].on_s = [], list(rows[1].off_s)
    again = calibrated_bounds(
        rows, threshold=64, block_size=BLOCK, tolerance=0.1, kv_bytes_per_token=1e3
    )
    assert again[2048][1] == pytest.approx(1.0)
    for r in (rows[0], rows[2]):
        assert again[r.history_tokens][1] == pytest.approx(r.speedup, rel=1e-9)


def _on_lines(
    fixed: float, recompute: float, overhead: float, per_token: float
) -> list[LengthResult]:
    """Rounds exactly on a recompute line and a pull line (µs), at three lengths."""
    out = []
    for n in (1024, 2048, 4096):
        prompt = n + 182
        off = (fixed + recompute * prompt) / 1e6
        on = (fixed + overhead + per_token * n + recompute * (prompt - n)) / 1e6
        out.append(LengthResult(n, prompt, [off] * 3, [on] * 3, [n] * 3, [n * 1e3] * 3))
    return out


@pytest.mark.parametrize(
    ("fixed", "recompute", "overhead", "per_token"),
    [
        (0.0, 100.0, 0.5, 0.5),  # no fixed cost, a pull cheaper than 1 µs per read and token
        (10_000.0, 0.0, 2000.0, 5.0),  # OFF flat: recompute costs nothing per token
    ],
)
def test_calibrated_lines_keep_small_and_zero_terms(
    fixed: float, recompute: float, overhead: float, per_token: float
) -> None:
    rows = _on_lines(fixed, recompute, overhead, per_token)
    bounds = calibrated_bounds(rows, threshold=64, block_size=BLOCK, tolerance=0.1)
    for r in rows:
        assert bounds[r.history_tokens][1] == pytest.approx(r.speedup, rel=1e-6)


def test_calibration_without_any_pull_and_a_failed_calibration() -> None:
    rows = _on_lines(5000.0, 100.0, 2000.0, 5.0)
    for r in rows:  # readback never engaged: ON is a recompute
        r.pulled_tokens, r.on_s = [], list(r.off_s)
    bounds = calibrated_bounds(rows, threshold=64, block_size=BLOCK, tolerance=0.1)
    assert [p for _, p in bounds.values()] == pytest.approx([1.0, 1.0, 1.0])
    with pytest.raises(GateFailure) as exc:
        calibrated_bounds(
            _on_lines(5000.0, 100.0, 2000.0, 5.0),
            threshold=64,
            block_size=BLOCK,
            tolerance=0.1,
            kv_bytes_per_token=-1.0,
        )
    assert str(exc.value) == "calibration failed: kv_bytes_per_token must be >= 0, got -1.0"


def test_decode_gate_edges_and_its_whole_messages() -> None:
    from bidir_kv.testing.hw_gates import gate_tpot

    off = [0.004] * 100
    at = gate_tpot("length 2000", off, [0.005] * 100, 25.0)  # exactly +25 %: passes
    assert at == "TPOT p99 ON 5.00 ms vs OFF 4.00 ms (+25.0 %; 100 ON and 100 OFF turns)"
    with pytest.raises(GateFailure) as exc:
        gate_tpot("point 8", off, [0.006] * 100, 25.0)
    assert str(exc.value) == (
        "point 8: decode regression beyond 25 %: TPOT p99 ON 6.00 ms vs OFF 4.00 ms "
        "(+50.0 %; 100 ON and 100 OFF turns)"
    )
    with pytest.raises(GateFailure) as zero:
        gate_tpot("p", [0.0] * 3, [0.001] * 3, 1000.0)  # OFF took no time: any ON is worse
    assert "(+inf %;" in str(zero.value)
    with pytest.raises(GateFailure) as none:
        gate_tpot("length 2000", [], [0.004], 20.0)
    assert str(none.value) == (
        "length 2000: no TPOT to compare (0 OFF and 1 ON turns decoded more than one token)"
    )
