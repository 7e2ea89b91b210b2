"""The fence's pure parts, the fence table and the peer allowlist (docs/connector.md §5, §7)."""

from __future__ import annotations

import pytest

from bidir_kv.engine.fencewords import FenceTable
from bidir_kv.policy import (
    PeerAllowlist,
    RetentionLedger,
    peer_entries,
    retention_budget_blocks,
)
from bidir_kv.wire.fence import (
    FENCE_KEY,
    advertises_fence,
    parse_budget,
    reader_advert,
    word_of,
    word_to_wire,
)


def test_advert_and_word_round_trip_and_reject_other_shapes() -> None:
    assert advertises_fence({FENCE_KEY: reader_advert()})
    for bad in (
        None,
        {},
        {FENCE_KEY: {"v": 2, "reads": True}},
        {FENCE_KEY: {"v": 1}},
        {FENCE_KEY: {"v": 1, "reads": "yes"}},
        {FENCE_KEY: True},
    ):
        assert not advertises_fence(bad)
    assert word_of({FENCE_KEY: word_to_wire(3, 99)}) == (3, 99)
    for bad_word in (
        {"v": 1, "slot": -1, "gen": 5},
        {"v": 1, "slot": 0, "gen": 0},
        {"v": 1, "slot": True, "gen": 5},
        {"v": 1, "slot": 0, "gen": 2**64},
        {"v": 2, "slot": 0, "gen": 5},
        {"v": 1, "slot": "0", "gen": 5},
    ):
        assert word_of({FENCE_KEY: bad_word}) is None


@pytest.mark.parametrize("value", [0, -0.1, 1.01, float("nan"), float("inf"), "0.5", True])
def test_budget_outside_0_1_is_a_problem_not_a_budget(value: object) -> None:
    budget, problem = parse_budget(value)
    assert budget is None and problem is not None and "(0, 1]" in problem


def test_budget_in_range_and_unset() -> None:
    assert parse_budget(None) == (None, None)
    assert parse_budget(1) == (1.0, None)
    assert parse_budget(0.25) == (0.25, None)
    assert retention_budget_blocks(0.5, 63) == 31
    with pytest.raises(ValueError):
        retention_budget_blocks(0, 63)


def test_table_bumps_before_reuse_and_keeps_the_value_on_completion() -> None:
    table = FenceTable(slots=2)
    slot_a, gen_a = table.export("a") or (0, 0)
    slot_b, gen_b = table.export("b") or (0, 0)
    assert slot_a != slot_b and gen_b > gen_a and table.export("c") is None  # full
    assert table.word(slot_a) == gen_a
    assert table.bump("a") and table.word(slot_a) != gen_a  # an early release changes it
    assert not table.bump("a")  # once
    table.done("b")  # the reader's notification: its word stays
    assert table.word(slot_b) == gen_b
    again = table.export("d")
    assert again is not None and again[0] == slot_a  # freed slots are reused oldest first
    assert again[1] not in (gen_a, gen_b)  # values never repeat


def test_ledger_counts_shared_blocks_once() -> None:
    ledger = RetentionLedger(ttl=10)
    ledger.retain("a", [1, 2, 3], 0)
    ledger.retain("b", [1, 2, 4], 0)
    assert ledger.held_blocks() == 4


def test_allowlist_matches_engine_ids_and_networks_never_names() -> None:
    allow = PeerAllowlist.parse(["10.0.0.0/8", "d-engine-1", "::1", "127.0.0.1"])
    assert allow is not None
    assert allow.allows("d-engine-1", "203.0.113.9")
    assert allow.allows("other", "10.2.3.4") and allow.allows(None, "127.0.0.1")
    assert allow.allows("other", "[::1]")
    assert not allow.allows("other", "127.0.0.2")
    assert not allow.allows("other", "localhost")  # a host name is never resolved
    assert not allow.allows(None, None)
    assert PeerAllowlist.parse(None) is None
    for bad in ("10.0.0.0/8", [], [""], [3], {"a": 1}):
        with pytest.raises(ValueError):
            PeerAllowlist.parse(bad)


def test_peer_entries_list_a_peer_by_its_address_else_by_its_engine_id() -> None:
    """What serve and the topologies write: never both for one peer (either admits)."""
    assert peer_entries([("d-1", "10.0.0.2")]) == ("10.0.0.2",)
    assert peer_entries([("d-1", "[fd00::2]"), ("d-2", "::1")]) == ("fd00::2", "::1")
    assert peer_entries([("d-1", "decode-host"), ("d-2", None)]) == ("d-1", "d-2")
    assert peer_entries(
        [("d-1", "127.0.0.1"), ("d-2", "127.0.0.1"), ("d-3", "h"), ("d-3", "h2")]
    ) == ("127.0.0.1", "d-3")  # order kept, no repeats
    assert peer_entries([(None, None), (None, "name"), ("", "")]) == ()
    assert peer_entries([]) == ()
    allow = PeerAllowlist.parse(list(peer_entries([("d-1", "10.0.0.2")])))
    assert allow is not None and allow.allows("stranger", "10.0.0.2")
    assert not allow.allows("d-1", "10.0.0.3")  # the id alone, at another host: refused


def test_connector_turns_budget_pressure_and_slots() -> None:
    from bidir_kv.connector.retention import BUMP_BIT, RetainedTurns

    turns = RetainedTurns(slots=2)
    a = turns.retain("a", 4, fenced=True)
    b = turns.retain("b", 4, fenced=True)
    assert a and b and a[0] != b[0] and b[1] > a[1] and b[1] < BUMP_BIT
    assert turns.retain("c", 4, fenced=True) is None  # no slot left: unfenced
    assert turns.retain("s", 4, fenced=False) is None
    assert turns.held_blocks() == 16
    # budget 0.5 of 20 blocks = 10: release oldest fenced only, never the kept turn
    assert turns.over_budget(0.5, 20, keep="b") == ["a"]
    assert turns.over_budget(0.5, 20, releasing={"a"}) == ["b"]
    assert turns.oldest_fenced() == "a" and turns.oldest_fenced(exclude={"a", "b"}) is None
    turns.finished("a")
    assert not turns.is_fenced("a") and turns.held_blocks() == 12
    again = turns.retain("d", 1, fenced=True)
    assert again is not None and again[0] == a[0] and again[1] > b[1]


def test_connector_budget_counts_turns_being_released_as_gone() -> None:
    """A turn already being released (its fence bumped, its blocks freed when the worker
    reports it) no longer counts as held: pressure never releases more turns than the
    budget needs (docs/connector.md §5)."""
    from bidir_kv.connector.retention import RetainedTurns

    turns = RetainedTurns(slots=8)
    for rid in "abcd":
        turns.retain(rid, 4, fenced=True)  # 16 blocks held, oldest first
    # a budget of 12 of 20 blocks: releasing "a" (4 blocks) is enough
    assert turns.over_budget(0.6, 20) == ["a"]
    # "a" is on its way out: the other 12 blocks fit, nothing more is released
    assert turns.over_budget(0.6, 20, releasing={"a"}) == []
    # a budget of 8: one more turn than "a", the oldest not already released
    assert turns.over_budget(0.4, 20, releasing={"a"}) == ["b"]
    assert turns.over_budget(0.4, 20, releasing={"a", "b"}) == []
    assert turns.over_budget(0.2, 20, keep="c", releasing={"a"}) == ["b", "d"]
