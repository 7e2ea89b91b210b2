"""The doctor's retained-share check on what a node's /metrics says (issue 33): our
gauge when exported; a vLLM D's usage only while it runs and queues nothing."""

from __future__ import annotations

from bidir_kv.doctor.checks import Context, check_retained_share
from bidir_kv.scrape import MetricsSnapshot, parse_metrics

D = "http://d:8200"


def _ctx(exposition: str | None) -> Context:
    ctx = Context(prefill_url="http://p:8100", decode_url=D, host_checks=False)
    ctx.cache[f"metrics:{D}"] = (
        None if exposition is None else MetricsSnapshot(parse_metrics(exposition))
    )
    return ctx


def _vllm(usage: float, running: int, waiting: int = 0, preempted: int = 0) -> str:
    return (
        f'vllm:kv_cache_usage_perc{{engine="0"}} {usage}\n'
        f'vllm:num_requests_running{{engine="0"}} {running}\n'
        f'vllm:num_requests_waiting{{engine="0"}} {waiting}\n'
        f'vllm:num_preemptions_total{{engine="0"}} {preempted}\n'
    )


def test_a_vllm_d_is_judged_by_its_usage_only_when_idle() -> None:
    idle = check_retained_share(_ctx(_vllm(0.7, running=0, preempted=3)))
    assert idle.status == "WARN"
    assert "70% of D's KV blocks (vllm:kv_cache_usage_perc while D runs nothing)" in idle.detail
    assert "preempted 3 requests" in idle.detail
    busy = check_retained_share(_ctx(_vllm(0.95, running=4)))
    assert busy.status == "PASS" and busy.detail.startswith("not checked: D is busy")
    queued = check_retained_share(_ctx(_vllm(0.95, running=0, waiting=1)))
    assert queued.detail.startswith("not checked")
    low = check_retained_share(_ctx(_vllm(0.2, running=0)))
    assert low.status == "PASS" and "20%" in low.detail


def test_our_gauge_wins_and_an_unreadable_d_fails() -> None:
    ours = _vllm(0.95, running=4) + 'bidir_kv:kv_cache_retained_perc{engine="0"} 0.3\n'
    assert check_retained_share(_ctx(ours)).status == "PASS"
    assert check_retained_share(_ctx("other_metric 1\n")).status == "WARN"
    assert check_retained_share(_ctx(None)).status == "FAIL"
