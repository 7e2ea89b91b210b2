"""D-side retention ledger, P-side leases, clock offset and the expiry decline
(docs/protocol.md §5, §8)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bidir_kv.policy import (
    DEFAULT_DECODER_KV_BLOCKS_TTL,
    DEFAULT_KV_LEASE_DURATION,
    EXPIRY_SAFETY_MARGIN,
    HandshakeSample,
    LeaseTable,
    Release,
    RetentionLedger,
    clock_offset,
    heartbeat_extension,
    heartbeat_interval,
    local_deadline,
    remote_deadline,
    retention_budget_releases,
    should_decline,
    valid_lease_duration,
    valid_retention_ttl,
)
from bidir_kv.testing.clock import ManualClock, OffsetClock

EPS = 1e-6


def test_defaults_are_vllms() -> None:
    assert DEFAULT_DECODER_KV_BLOCKS_TTL == 480
    assert DEFAULT_KV_LEASE_DURATION == 30
    assert EXPIRY_SAFETY_MARGIN == 5.0
    assert RetentionLedger().ttl == 480
    assert RetentionLedger().renewable is False


# ---- RetentionLedger (D) ------------------------------------------------------


def test_retain_exports_finish_plus_ttl() -> None:
    ledger = RetentionLedger(ttl=480)
    deadline = ledger.retain("d-1", [7, 8], now=358.03)
    assert deadline == pytest.approx(838.03)
    assert ledger.deadline("d-1") == deadline
    assert ledger.blocks("d-1") == (7, 8)
    assert "d-1" in ledger and len(ledger) == 1
    assert ledger.next_deadline() == deadline


def test_unknown_ids_read_as_none() -> None:
    ledger = RetentionLedger()
    assert ledger.deadline("x") is None
    assert ledger.blocks("x") is None
    assert ledger.next_deadline() is None
    assert not ledger.is_readable("x", now=0.0)


def test_retaining_twice_is_an_error() -> None:
    ledger = RetentionLedger()
    ledger.retain("d-1", [1], now=0)
    with pytest.raises(ValueError, match="already retained"):
        ledger.retain("d-1", [2], now=1)


@pytest.mark.parametrize("ttl", [0, -1.0])
def test_ttl_must_be_positive(ttl: float) -> None:
    with pytest.raises(ValueError, match="decoder_kv_blocks_ttl"):
        RetentionLedger(ttl=ttl)


def test_single_notification_releases() -> None:
    ledger = RetentionLedger()
    ledger.retain("d-1", [3, 4, 5], now=0)
    release = ledger.notify("d-1")
    assert release == Release("d-1", (3, 4, 5), "notified", 1)
    assert "d-1" not in ledger and len(ledger) == 0


@pytest.mark.parametrize("n", [2, 3, 4])
def test_release_only_after_n_consumers(n: int) -> None:
    ledger = RetentionLedger()
    ledger.retain("d-1", [9], now=0)
    for _ in range(n - 1):
        assert ledger.notify("d-1", expected_consumers=n) is None
        assert "d-1" in ledger
    release = ledger.notify("d-1", expected_consumers=n)
    assert release is not None and release.reads == n and release.reason == "notified"
    assert "d-1" not in ledger


def test_notification_for_unknown_id_raises_key_error() -> None:
    ledger = RetentionLedger()
    with pytest.raises(KeyError):
        ledger.notify("never-retained")
    # and after release, a second notification is unknown too (single use)
    ledger.retain("d-1", [1], now=0)
    ledger.notify("d-1")
    with pytest.raises(KeyError):
        ledger.notify("d-1")


def test_expected_consumers_must_be_positive() -> None:
    ledger = RetentionLedger()
    ledger.retain("d-1", [1], now=0)
    with pytest.raises(ValueError, match="expected_consumers"):
        ledger.notify("d-1", expected_consumers=0)
    assert "d-1" in ledger


def test_reap_releases_exactly_at_the_deadline() -> None:
    ledger = RetentionLedger(ttl=10)
    ledger.retain("a", [1], now=0)
    ledger.retain("b", [2], now=5)
    assert ledger.reap(now=10 - EPS) == []
    assert ledger.is_readable("a", now=10 - EPS)
    assert not ledger.is_readable("a", now=10)
    released = ledger.reap(now=10)
    assert released == [Release("a", (1,), "expired", 0)]
    assert "a" not in ledger and "b" in ledger
    assert ledger.reap(now=14.999) == []
    assert [r.request_id for r in ledger.reap(now=100)] == ["b"]
    assert len(ledger) == 0


def test_reap_reports_partial_reads() -> None:
    ledger = RetentionLedger(ttl=10)
    ledger.retain("a", [1], now=0)
    assert ledger.notify("a", expected_consumers=2) is None
    (release,) = ledger.reap(now=10)
    assert release.reads == 1 and release.reason == "expired"


def test_fixed_ledger_never_renews() -> None:
    ledger = RetentionLedger(ttl=10)
    ledger.retain("a", [1], now=0)
    with pytest.raises(PermissionError, match="renewable=True"):
        ledger.renew("a", now=5)
    assert ledger.deadline("a") == 10


def test_renewable_ledger_extends_and_never_shortens() -> None:
    ledger = RetentionLedger(ttl=10, renewable=True)
    ledger.retain("a", [1], now=0)
    assert ledger.renew("a", now=8) == 18
    assert ledger.renew("a", now=1) == 18  # an old heartbeat cannot shorten it
    assert ledger.reap(now=17.9) == []
    # idle: no more renewals, so it lapses at the last deadline
    assert [r.request_id for r in ledger.reap(now=18)] == ["a"]
    with pytest.raises(KeyError):
        ledger.renew("a", now=19)


# ---- heartbeats and LeaseTable (P) ----------------------------------------------


def test_heartbeat_interval_and_extension_defaults() -> None:
    assert heartbeat_interval(30) == 5
    assert heartbeat_extension(30) == 20
    assert heartbeat_interval(7) == 1 and heartbeat_extension(7) == 4


@pytest.mark.parametrize("fn", [heartbeat_interval, heartbeat_extension])
@pytest.mark.parametrize("duration", [0, -30])
def test_heartbeat_needs_positive_duration(fn, duration: int) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="kv_lease_duration"):
        fn(duration)


def test_lease_table_rejects_bad_duration() -> None:
    with pytest.raises(ValueError):
        LeaseTable(duration=0)


def test_lease_hold_and_heartbeat_is_max_of_old_and_now_plus_20() -> None:
    leases = LeaseTable()
    assert leases.hold("p-1", now=100) == 130
    assert "p-1" in leases and len(leases) == 1
    # early heartbeat: now + 20 = 105 + 20 = 125 < 130 keeps the old expiry
    assert leases.heartbeat(["p-1"], now=105) == {"p-1": 130}
    # later heartbeat: 115 + 20 = 135 > 130 extends
    assert leases.heartbeat(["p-1"], now=115) == {"p-1": 135}
    assert leases.expiry("p-1") == 135
    # exactly equal: max keeps the same value
    assert leases.heartbeat(["p-1"], now=115) == {"p-1": 135}


def test_heartbeat_ignores_unknown_ids() -> None:
    leases = LeaseTable()
    leases.hold("p-1", now=0)
    assert leases.heartbeat(["nope", "p-1"], now=20) == {"p-1": 40}
    assert "nope" not in leases
    assert leases.expiry("nope") is None


def test_heartbeats_every_interval_keep_a_lease_alive_and_it_lapses_20s_after_the_last() -> None:
    clock = ManualClock(1000.0)
    leases = LeaseTable(duration=30)
    leases.hold("p-1", now=clock.now())
    step = heartbeat_interval(leases.duration)
    for _ in range(20):  # 100 s of heartbeats every 5 s, far past the 30 s lease
        clock.advance(step)
        assert leases.reap(clock.now()) == []
        leases.heartbeat(["p-1"], now=clock.now())
    last = clock.now()
    assert leases.expiry("p-1") == last + 20
    # D died: no more heartbeats
    assert leases.reap(last + 20 - EPS) == []
    assert leases.reap(last + 20) == ["p-1"]
    assert len(leases) == 0


def test_lease_release() -> None:
    leases = LeaseTable()
    leases.hold("p-1", now=0)
    assert leases.release("p-1") is True
    assert leases.release("p-1") is False
    assert leases.reap(now=10**6) == []


# ---- clock offset and the decline (PR #47021) ---------------------------------


def test_clock_offset_uses_the_lowest_rtt_sample() -> None:
    samples = [
        HandshakeSample(send=10.0, recv=10.4, remote_now=1010.5),  # rtt 0.4
        HandshakeSample(send=11.0, recv=11.1, remote_now=1011.05),  # rtt 0.1 -> best
        HandshakeSample(send=12.0, recv=12.3, remote_now=1011.0),
    ]
    assert samples[1].rtt == pytest.approx(0.1)
    assert clock_offset(samples) == pytest.approx(1011.05 - 11.05)


@pytest.mark.parametrize("offset", [-7200.25, -3.0, 0.0, 3.0, 86400.5])
def test_clock_offset_recovers_a_known_offset(offset: float) -> None:
    p = ManualClock(500.0)
    d = OffsetClock(p, offset)  # D's clock = P's clock + offset
    send = p.now()
    p.advance(0.002)
    remote = d.now()  # D answers at the midpoint
    p.advance(0.002)
    sample = HandshakeSample(send=send, recv=p.now(), remote_now=remote)
    assert clock_offset([sample]) == pytest.approx(offset)


def test_clock_offset_rejects_bad_samples() -> None:
    with pytest.raises(ValueError, match="at least one"):
        clock_offset([])
    with pytest.raises(ValueError, match="negative RTT"):
        clock_offset([HandshakeSample(send=2.0, recv=1.0, remote_now=0.0)])


@pytest.mark.parametrize("offset", [-1000.0, 0.0, 1000.0], ids=["D-behind", "same", "D-ahead"])
def test_decline_just_before_and_after_the_margin(offset: float) -> None:
    # D's deadline is 100 s on P's clock; D exports it on its own clock
    remote_expiry = 100.0 + offset
    assert local_deadline(remote_expiry, offset) == pytest.approx(100.0)

    def declines(now: float) -> bool:
        return should_decline(remote_expiry=remote_expiry, offset=offset, now=now)

    assert not declines(0.0)
    assert not declines(95.0 - 1e-3)
    assert declines(95.0)  # now + 5 == deadline: declined (>=)
    assert declines(95.0 + 1e-3)
    assert declines(100.0)
    assert declines(200.0)


def test_wrong_sign_of_offset_would_flip_the_decision() -> None:
    # A regression guard on the direction of the conversion: D ahead by 1000 s.
    offset = 1000.0
    remote_expiry = 1100.0  # = 100 s on P's clock
    assert not should_decline(remote_expiry=remote_expiry, offset=offset, now=90.0)
    assert should_decline(remote_expiry=remote_expiry, offset=offset, now=96.0)
    # the same reading with the offset's sign flipped would read a lapsed handle
    assert not should_decline(remote_expiry=remote_expiry, offset=-offset, now=96.0)


def test_null_expiry_never_declines() -> None:
    assert not should_decline(remote_expiry=None, offset=0.0, now=10**9)


def test_custom_margin() -> None:
    assert not should_decline(remote_expiry=100.0, offset=0.0, now=89.0, margin=10.0)
    assert should_decline(remote_expiry=100.0, offset=0.0, now=90.0, margin=10.0)
    assert should_decline(remote_expiry=100.0, offset=0.0, now=100.0, margin=0.0)


def test_end_to_end_retention_export_and_decline_across_clocks() -> None:
    """D retains on its clock, P estimates the offset and decides at the right moment."""
    p_clock = ManualClock(50.0)
    d_clock = OffsetClock(p_clock, 12345.678)
    ledger = RetentionLedger(ttl=30)
    exported = ledger.retain("d-1", [1, 2], now=d_clock.now())
    send = p_clock.now()
    sample = HandshakeSample(send=send, recv=send, remote_now=d_clock.now())
    offset = clock_offset([sample])
    # 24.9 s later: 30 - 24.9 = 5.1 s left > margin -> read
    p_clock.advance(24.9)
    assert not should_decline(remote_expiry=exported, offset=offset, now=p_clock.now())
    assert ledger.is_readable("d-1", d_clock.now())
    # 25.0 s: exactly at the margin -> decline, although D would still serve it
    p_clock.advance(0.1)
    assert should_decline(remote_expiry=exported, offset=offset, now=p_clock.now())
    assert ledger.is_readable("d-1", d_clock.now())
    p_clock.advance(5.0)
    assert [r.reason for r in ledger.reap(d_clock.now())] == ["expired"]


@given(
    st.floats(-1e6, 1e6, allow_nan=False),
    st.floats(0.0, 1e5, allow_nan=False),
    st.floats(0.0, 1e5, allow_nan=False),
)
def test_decline_is_monotone_in_time(offset: float, deadline: float, now: float) -> None:
    """Once P declines a handle it keeps declining it later."""
    remote = deadline + offset
    if should_decline(remote_expiry=remote, offset=offset, now=now):
        assert should_decline(remote_expiry=remote, offset=offset, now=now + 1.0)
        assert should_decline(remote_expiry=remote, offset=offset, now=now + 1e3)


@given(st.floats(-1e6, 1e6), st.floats(-1e3, 1e3))
def test_remote_deadline_is_the_inverse_of_local_deadline(deadline: float, offset: float) -> None:
    assert abs(local_deadline(remote_deadline(deadline, offset), offset) - deadline) < 1e-6


def test_knob_validity() -> None:
    assert valid_retention_ttl(0.5) and not valid_retention_ttl(0) and not valid_retention_ttl(-1)
    assert valid_lease_duration(6) and valid_lease_duration(DEFAULT_KV_LEASE_DURATION)
    assert not valid_lease_duration(5) and not valid_lease_duration(0)
    assert not valid_lease_duration(-30)


# ---- the retention budget: which retained turns D releases (docs/connector.md §5.3) ----


def _turns(**blocks: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    return dict(blocks)


def test_budget_releases_the_oldest_candidates_until_the_cap_holds() -> None:
    held = _turns(a=(1, 2, 3, 4), b=(5, 6, 7, 8), c=(9, 10, 11, 12))
    # 0.5 of 20 blocks = 10; 12 held: the oldest candidate goes, then 8 fit
    assert retention_budget_releases(held, ["a", "b", "c"], 0.5, 20) == ["a"]
    assert retention_budget_releases(held, ["a", "b", "c"], 0.25, 20) == ["a", "b"]  # cap 5
    assert retention_budget_releases(held, ["c", "a"], 0.5, 20) == ["c"]  # the caller's order
    assert retention_budget_releases(held, ["a", "b", "c"], 0.6, 20) == []  # 12 fit in 12


def test_budget_never_releases_a_turn_that_is_not_a_candidate() -> None:
    held = _turns(a=(1, 2, 3, 4), b=(5, 6, 7, 8), keep=(9, 10, 11, 12))
    # cap 2: even releasing every candidate leaves the kept turn's 4 blocks over it
    assert retention_budget_releases(held, ["a", "b"], 0.1, 20) == ["a", "b"]
    assert retention_budget_releases(held, ["ghost", "a", "a", "b"], 0.1, 20) == ["a", "b"]


def test_budget_turns_already_releasing_are_not_held() -> None:
    """Pressure or an earlier retain is releasing ``a``: its blocks are on their way
    out, so the budget does not release ``b`` for them as well."""
    held = _turns(a=(1, 2, 3, 4), b=(5, 6, 7, 8), c=(9, 10, 11, 12))
    assert retention_budget_releases(held, ["a", "b", "c"], 0.5, 20, releasing={"a"}) == []
    assert retention_budget_releases(held, ["a", "b", "c"], 0.25, 20, releasing={"a"}) == ["b"]


def test_budget_counts_a_block_two_turns_share_once() -> None:
    """Turn 2 of a conversation reused turn 1's blocks on D: 6 distinct blocks, not 10."""
    held = _turns(t1=(1, 2, 3, 4), t2=(1, 2, 3, 4, 5, 6))
    assert retention_budget_releases(held, ["t1", "t2"], 0.3, 20) == []  # cap 6
    # cap 5: t1 goes first (oldest) but frees nothing t2 still holds, so t2 goes too
    assert retention_budget_releases(held, ["t1", "t2"], 0.25, 20) == ["t1", "t2"]
    # a block shared with a releasing turn is still held by the other
    assert retention_budget_releases(held, ["t2"], 0.2, 20, releasing={"t1"}) == ["t2"]


def test_budget_outside_0_1_is_refused() -> None:
    with pytest.raises(ValueError):
        retention_budget_releases({}, [], 0.0, 20)


@given(
    st.lists(st.sets(st.integers(1, 30), max_size=6), max_size=8),
    st.sets(st.integers(0, 7)),
    st.sets(st.integers(0, 7)),
    st.integers(1, 10).map(lambda n: n / 10),
)
def test_budget_releases_exactly_enough_in_order(
    blocks: list[set[int]], not_candidates: set[int], releasing_ix: set[int], budget: float
) -> None:
    held = {f"t{i}": tuple(b) for i, b in enumerate(blocks)}
    candidates = [rid for i, rid in enumerate(held) if i not in not_candidates]
    releasing = {f"t{i}" for i in releasing_ix}
    out = retention_budget_releases(held, candidates, budget, 30, releasing=releasing)
    cap = int(budget * 30)

    def still_held(gone: set[str]) -> int:
        return len({b for rid, bs in held.items() if rid not in gone for b in bs})

    assert out == [rid for rid in candidates if rid in out]  # the candidates' order
    assert not set(out) & releasing
    gone = releasing | set(out)
    usable = [rid for rid in candidates if rid not in releasing]
    assert still_held(gone) <= cap or set(out) == set(usable)  # enough, or all it may
    if out:  # and no more than enough: without the last one it was still over
        assert still_held(gone - {out[-1]}) > cap
