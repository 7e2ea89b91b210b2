"""The eviction order of D's retained turns under memory pressure (issue 16)."""

from __future__ import annotations

import pytest

from bidir_kv.policy import RetentionLedger, retained_eviction_order

pytestmark = pytest.mark.unit


def test_oldest_retention_goes_first_and_busy_ones_never() -> None:
    order = retained_eviction_order({"new": 30.0, "old": 10.0, "mid": 20.0}, busy={"mid"})
    assert order == ["old", "new"]


def test_ties_break_by_id() -> None:
    assert retained_eviction_order({"b": 1.0, "a": 1.0}) == ["a", "b"]


def test_ledger_evict_releases_the_entry_with_its_reason() -> None:
    ledger = RetentionLedger(ttl=10)
    ledger.retain("r1", [3, 4], now=0.0)
    assert ledger.deadlines() == {"r1": 10.0}
    rel = ledger.evict("r1")
    assert rel.reason == "evicted" and rel.blocks == (3, 4)
    assert "r1" not in ledger
    with pytest.raises(KeyError):
        ledger.evict("r1")
