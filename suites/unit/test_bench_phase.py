"""Which phase state two closed-loop clients ran in (``bench.phase``): the fact the
headline adds, because the OFF TTFT at a long prompt depends on it."""

from __future__ import annotations

from bidir_kv.bench.phase import overlapped_turns
from bidir_kv.bench.stats import RequestRecord


def _rec(client: int, start: float, ttft: float, turn: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        ttft_ms=ttft,
        tpot_ms=4.0,
        latency_ms=ttft + 1400.0,
        start_time_ms=start,
        input_num_turns=turn,
        input_num_tokens=24000,
        output_num_tokens=300,
        output_num_chunks=300,
        output_num_first_chunk_tokens=1,
        approx_cached_percent=0.0,
        conversation_id=f"c{client}",
        client_id=client,
        turn=turn,
        ok=ok,
    )


def _two_clients(
    offset: float,
    ttft: float,
    turns: int = 10,
    cycle: float = 2100.0,
) -> list[RequestRecord]:
    return [_rec(c, t * cycle + c * offset, ttft, t + 1) for t in range(turns) for c in (0, 1)]


def test_staggered_clients_touch_only_at_the_edges() -> None:
    # the second client starts 650 ms after the first, whose TTFT is 700 ms: a 50 ms edge
    assert overlapped_turns(_two_clients(650.0, 700.0), min_turn=3) == (0, 16)


def test_overlapped_clients_share_every_turn() -> None:
    assert overlapped_turns(_two_clients(400.0, 880.0), min_turn=3) == (16, 16)


def test_one_client_and_failed_requests_never_overlap() -> None:
    one = [_rec(0, t * 2100.0, 880.0, t + 1) for t in range(10)]
    assert overlapped_turns(one, min_turn=1) == (0, 10)
    # a failed request of the other client is no turn on P; a failed turn is not measured
    failed = [*one, *(_rec(1, t * 2100.0 + 100, 880.0, t + 1, ok=False) for t in range(10))]
    assert overlapped_turns(failed, min_turn=1) == (0, 10)


def test_a_long_turn_long_before_still_counts() -> None:
    # the other client's turn started 3 s earlier and lasts 4 s: it covers this one
    recs = [_rec(1, 0.0, 4000.0, 1), _rec(0, 3000.0, 500.0, 2)]
    assert overlapped_turns(recs, min_turn=2) == (1, 1)


def test_the_headline_names_the_state() -> None:
    from bidir_kv.report.headline import Headline, headline_text

    base = dict(
        point=24000, ratio=1.9, engine_cpu_ms=20.0, on_prefill_ms=400.0, foreign_load_per_core=0.1
    )
    text = headline_text(Headline(**base, off_overlapped=(38, 40)))  # type: ignore[arg-type]
    assert "OFF turns overlapping another client's on P: 38 of 40 (overlapped clients" in text
    text = headline_text(Headline(**base, off_overlapped=(0, 40)))  # type: ignore[arg-type]
    assert "0 of 40 (staggered clients" in text
    assert "overlapping" not in headline_text(Headline(**base))  # type: ignore[arg-type]
