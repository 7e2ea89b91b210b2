"""The fence's pure parts, both D's fence state and the peer allowlist (docs/connector.md
§5, §7)."""

from __future__ import annotations

import logging

import pytest

from bidir_kv.connector.fence import FenceMeta, SchedulerFence, WordCheck
from bidir_kv.engine.fencewords import FenceTable, fence_from_config
from bidir_kv.policy import (
    PeerAllowlist,
    RetentionLedger,
    peer_entries,
    retention_budget_blocks,
)
from bidir_kv.wire.fence import (
    BUMP_BIT,
    FENCE_KEY,
    FenceConfig,
    FenceSlots,
    advertises_fence,
    bumped,
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


def test_slots_values_grow_and_freed_slots_are_reused_last() -> None:
    slots = FenceSlots(3, first_gen=100)
    a, b = slots.export("a"), slots.export("b")
    assert a == (0, 101) and b == (1, 102)
    assert slots.export("a") == a  # a turn keeps its word
    assert slots.release("a") == 0 and slots.release("a") is None
    assert slots.export("c") == (2, 103)  # the never-used slot first, then the freed one
    assert slots.export("d") == (0, 104) and slots.export("e") is None  # full
    assert "d" in slots and "a" not in slots and len(slots) == 3
    with pytest.raises(ValueError):
        FenceSlots(0)
    # values start at the clock (ms << 16): far below the bump bit, above any earlier start
    assert 0 < FenceSlots(1).export("x")[1] < BUMP_BIT  # type: ignore[index]


def test_a_bumped_word_never_equals_an_exported_value() -> None:
    assert bumped(5) == 5 | BUMP_BIT and bumped(bumped(5)) == bumped(5)
    assert bumped(5) != 5 and bumped(5) < 2**64


def test_config_a_bad_value_is_a_problem_and_stock_behaviour() -> None:
    assert FenceConfig.from_extra(None) == FenceConfig(fence=True, budget=None, problems=())
    good = FenceConfig.from_extra({"bidir_kv_fence": False, "bidir_kv_retention_budget": 0.5})
    assert good == FenceConfig(fence=False, budget=0.5, problems=())
    bad = FenceConfig.from_extra({"bidir_kv_fence": "yes", "bidir_kv_retention_budget": 2})
    assert not bad.fence and bad.budget is None and len(bad.problems) == 2
    assert "bidir_kv_fence must be true or false, got 'yes'" in bad.problems[0]
    assert "must be a share in (0, 1], got 2" in bad.problems[1]


def test_engine_fence_from_config_warns_once_per_bad_key(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="bidir_kv.engine"):
        assert fence_from_config({"bidir_kv_fence": 1}, pinned=False) is None
    assert [r.getMessage().count("must be true or false") for r in caplog.records] == [1]
    table = fence_from_config({"bidir_kv_retention_budget": 0.5}, pinned=False)
    assert table is not None and table.budget == 0.5
    assert fence_from_config({}, pinned=True) is None  # vLLM's pinned mode: no fence


ADVERT = {"do_remote_prefill": False, "remote_engine_id": "p", FENCE_KEY: reader_advert()}


def _d_fence(**extra: object) -> SchedulerFence:
    fence = SchedulerFence(extra, bidirectional=True, total_blocks=20, slots=2)
    fence.worker_ready([4096])
    return fence


def test_connector_d_exports_words_and_the_budget_releases_the_oldest_fenced_turn() -> None:
    d = _d_fence(bidir_kv_retention_budget=0.5)  # 10 of 20 blocks
    wa = d.retain("a", ADVERT, [[1, 2, 3, 4]])
    wb = d.retain("b", ADVERT, [[5, 6, 7, 8]])
    assert wa is not None and wb is not None and wa["base"] == 4096
    assert word_of({FENCE_KEY: wa}) != word_of({FENCE_KEY: wb})
    assert set(d.take_meta().writes) == {"a", "b"}
    assert d.retain("c", ADVERT, [[9, 10, 11, 12]]) is None  # no slot left: unfenced
    # 12 blocks held: the oldest fenced turn is released; 8 left
    assert d.take_meta().release == {"a"}
    assert d.retain("s", {"remote_engine_id": "q"}, [[13, 14]]) is None  # no advert: unfenced
    assert not d.take_meta().release  # 10 held: "a" is on its way out, so it fits
    d.retain("t", {"remote_engine_id": "q"}, [[15]])
    # 11: the next fenced turn goes, never an unfenced one (nothing guards their reads)
    meta = d.take_meta()
    assert meta.release == {"b"} and not meta.writes
    assert d.num_released_early["budget"] == 2
    assert d.take_meta() == FenceMeta()  # each order is sent once
    # the worker reports them done sending: slots are freed and reused, oldest first
    d.sent(["a", "b", "c", "s", "t"])
    assert d.state() == dict.fromkeys(d.state(), 0)
    again = d.retain("d", ADVERT, [[1]])
    assert again is not None and again["slot"] == wa["slot"] and again["gen"] > wb["gen"]


def test_connector_d_pressure_releases_one_fenced_turn_per_repeated_ask() -> None:
    d = _d_fence()
    d.retain("a", ADVERT, [[1, 2]])
    d.retain("b", ADVERT, [[3, 4]])
    d.take_meta()
    d.asked("w")
    assert not d.take_meta().release  # a first ask is no sign of pressure
    d.asked("w")  # asked again with no allocation: it waits for blocks
    assert d.take_meta().release == {"a"} and d.num_released_early["pressure"] == 1
    d.asked("w")  # "a" is on its way out: the next one goes
    assert d.take_meta().release == {"b"}
    d.asked("w")
    assert not d.take_meta().release  # nothing fenced left
    d.allocated("w")
    d.sent(["a", "b"])
    assert d.state() == dict.fromkeys(d.state(), 0)


def test_connector_p_advertises_and_checks_only_when_its_worker_reads_words() -> None:
    p = SchedulerFence({}, bidirectional=True, total_blocks=20)
    assert p.advert() is None  # before the handshake
    p.worker_ready([None])  # the words could not be registered: the fence is off
    assert p.advert() is None and not p.enabled
    p = SchedulerFence({}, bidirectional=True, total_blocks=20)
    p.worker_ready([4096, 8192])  # two workers (TP 2): off
    assert not p.enabled and p.advert() is None
    p = SchedulerFence({}, bidirectional=True, total_blocks=20)
    p.worker_ready([4096])
    assert advertises_fence({FENCE_KEY: p.advert()})
    d_dict = {"remote_engine_id": "d", FENCE_KEY: word_to_wire(3, 99, base=8192)}
    p.check_after_read("r", d_dict)
    p.check_after_read("stock", {"remote_engine_id": "d2"})  # no word: a stock read
    assert p.take_meta().checks == {"r": WordCheck(3, 99, 8192, "d")}
    off = SchedulerFence({"bidir_kv_fence": False}, bidirectional=True, total_blocks=20)
    off.worker_ready([4096])
    assert off.advert() is None and off.retain("a", ADVERT, [[1]]) is None
    assert SchedulerFence({}, bidirectional=False, total_blocks=20).enabled is False


def test_emulated_d_bumps_the_word_of_a_turn_whose_reader_is_dropped() -> None:
    """``POST /drop_peer``: a gone reader's claimed turn is freed without its
    notification, so its word changes and its slot goes back to the table."""
    from types import SimpleNamespace
    from typing import Any, cast

    from bidir_kv.config import KVTransferConfig
    from bidir_kv.engine.kvcache import BlockManager
    from bidir_kv.engine.metrics import EngineMetrics
    from bidir_kv.engine.owner import HandleOwner
    from bidir_kv.engine.profiles import CostProfile
    from bidir_kv.engine.settings import EngineSettings
    from bidir_kv.engine.transport.base import KVPool

    profile = CostProfile("tiny", kv_bytes_per_token=8, num_layers=2)
    kv = KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    settings = EngineSettings(model="m", served_names=["m"], kv=kv, profile=profile)
    blocks = BlockManager(KVPool.allocate(9, 16 * 8), 16, 2, enable_prefix_caching=False)
    table = FenceTable(slots=1)
    worker = cast(Any, SimpleNamespace(clock=lambda: 0.0, fence=table))
    owner = HandleOwner(settings, blocks, worker, EngineMetrics("m"), wake=lambda: None)
    held = blocks.allocate(2)
    owner.ledger.retain("t", held, 0.0)
    slot, gen = table.export("t") or (0, 0)
    assert owner.claim("t", held, reader="p-1") is None
    assert owner.drop_reader("p-1") == 2
    assert table.word(slot) != gen and not table.is_fenced("t")
    assert table.export("next") is not None  # the one slot is free again


def test_connector_budget_counts_turns_being_released_as_gone() -> None:
    """A turn already being released (its word bumped, its blocks freed when the worker
    reports it) no longer counts as held: a retain never releases more turns than the
    budget needs (docs/connector.md §5; #31's behaviour 3, through the shared rule)."""
    d = SchedulerFence(
        {"bidir_kv_retention_budget": 0.6}, bidirectional=True, total_blocks=20, slots=8
    )
    d.worker_ready([4096])
    for i, rid in enumerate("abcd"):  # 4 blocks each; the cap is 12
        d.retain(rid, ADVERT, [[4 * i + 1, 4 * i + 2, 4 * i + 3, 4 * i + 4]])
    assert d.take_meta().release == {"a"}  # 16 held: releasing "a" is enough
    d.retain("e", ADVERT, [[17, 18, 19, 20]])
    # "a" is on its way out (not yet reported sent): b..e hold 16, so only "b" goes
    assert d.take_meta().release == {"b"}
    d.sent(["a", "b"])
    d.retain("f", ADVERT, [[1, 2, 3, 4]])
    assert d.take_meta().release == {"c"}
    assert d.num_released_early["budget"] == 3
