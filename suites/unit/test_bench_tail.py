"""The tail of a point's router prefill histogram: the few requests that decide its mean."""

from __future__ import annotations

from bidir_kv.plan.tail import prefill_tail, tail_text

BASE = "bidir_kv_router_prefill_duration_seconds"


def _info(cumulative: dict[str, float], total_s: float) -> dict:
    rows = [[f"{BASE}_bucket", {"le": le, "outcome": "ok"}, c] for le, c in cumulative.items()]
    n = max(cumulative.values())
    rows += [
        [f"{BASE}_sum", {"outcome": "ok"}, total_s],
        [f"{BASE}_count", {"outcome": "ok"}, n],
        [f"{BASE}_count", {"outcome": "error"}, 5.0],  # failed legs are not the run's
    ]
    return {"metrics_delta": {"router0": rows}}


def test_two_slow_requests_of_twelve_are_a_tail_with_their_least_share() -> None:
    # 10 requests at <= 1 s (median bucket 0.5-1.0 s), 2 at 2.5-5 s
    info = _info({"0.25": 4, "0.5": 5, "1.0": 10, "2.5": 10, "5.0": 12, "+Inf": 12}, 10.5)
    tail = prefill_tail(info)
    assert tail is not None
    assert (tail.requests, tail.of, tail.median_le_s, tail.tail_from_s) == (2, 12, 1.0, 2.5)
    assert abs(tail.mean_share_ms - 2 * 2500 / 12) < 1e-9
    assert "2 of 12 requests took > 2.5 s" in tail_text(tail)


def test_a_tight_histogram_has_no_tail() -> None:
    assert prefill_tail(_info({"0.25": 2, "0.5": 12, "1.0": 12, "+Inf": 12}, 4.0)) is None
    assert prefill_tail({"metrics_delta": {"router0": []}}) is None
