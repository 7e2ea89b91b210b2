"""Expiry, decline, failure policies, single use and faults (docs/protocol.md §5, §7, §15.4-5).

P runs with ``--no-enable-prefix-caching`` here (the AWS blog's setting), so every
turn-2 read covers D's whole history and the threshold never hides a read.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from bidir_kv.client import StreamCut, TransportError, fetch
from bidir_kv.testing.engines import EnginePair, random_prompt, sources
from bidir_kv.testing.faults import confirm_counter_rose, stop_process
from bidir_kv.testing.poll import wait_for

FAILED = "vllm:nixl_num_failed_transfers_total"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
XFERS = "vllm:nixl_xfer_time_seconds_count"
NO_P_CACHE: dict[str, Any] = {"enable_prefix_caching": False}

Factory = Callable[..., EnginePair]


def _history(pair: EnginePair, seed: str, n: int = 300, gen: int = 8):
    rng = random.Random(seed)
    prompt = random_prompt(rng, n)
    _, d = pair.turn(prompt, gen)
    assert d is not None and d.ok and d.params is not None
    return rng, prompt, d


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_decline_near_expiry_follows_failure_policy(engine_pair: Factory, policy: str) -> None:
    """D's exported deadline is skewed to 4 s ahead: P must decline (now + 5 >= deadline),
    log it, count it, not notify D, then fail with 500 or recompute - never hang."""
    pair = engine_pair(prefill=NO_P_CACHE, prefill_kv={"kv_load_failure_policy": policy})
    pair.set_faults("d", clock_skew=-476.0)  # TTL 480 -> exported deadline = now + 4 s
    rng, prompt, d1 = _history(pair, f"decline-{policy}")
    prompt2 = [*prompt, *d1.token_ids, *random_prompt(rng, 50)]
    mark = pair.p.log_mark()
    p0, d0 = pair.snap()
    pr = pair.p.complete(prompt2, 1, d1.params.for_prefill_hit(), timeout=30)
    p1, d1m = pair.snap()
    log = pair.p.log_since(mark)
    assert "Declining expired remote read for cmpl-" in log
    assert f"from engine {d1.params.remote_engine_id}." in log
    assert d1.params.remote_engine_id.startswith("decode-engine-000-")
    dp = p1 - p0
    assert dp.value(EXPIRED) == 1
    assert dp.value(FAILED) == 0  # a decline is not a failed transfer
    assert dp.value(XFERS) == 0
    if policy == "fail":
        assert pr.status == 500 and "Internal server error" in (pr.error or "")
    else:
        assert pr.ok
        assert sources(dp) == {
            "local_compute": len(prompt2),
            "local_cache_hit": 0,
            "external_kv_transfer": 0,
        }
    # no notification: D still retains the turn-1 blocks
    assert pair.state("d")["retained"] == 1
    assert (d1m - d0).value(EXPIRED) == 0


def test_d_releases_retained_blocks_at_ttl(engine_pair: Factory) -> None:
    pair = engine_pair(decode_kv={"decoder_kv_blocks_ttl": 1.0})
    mark = pair.d.log_mark()
    d0 = pair.d.metrics()
    _, _, d1 = _history(pair, "ttl", n=100, gen=4)
    wait_for(lambda: pair.state("d")["retained"] == 0, timeout=10)
    assert (pair.d.metrics() - d0).value(EXPIRED) == 1
    assert (
        f"Releasing expired KV blocks for request {d1.params.remote_request_id} which were "
        "retrieved by 0 remote worker(s) before lease expired." in pair.d.log_since(mark)
    )


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_read_follows_failure_policy(engine_pair: Factory, policy: str) -> None:
    pair = engine_pair(prefill=NO_P_CACHE, prefill_kv={"kv_load_failure_policy": policy})
    rng, prompt, d1 = _history(pair, f"failread-{policy}")
    pair.set_faults("p", fail_transfers=1.0)
    prompt2 = [*prompt, *d1.token_ids, *random_prompt(rng, 50)]
    p0 = pair.p.metrics()
    pr = pair.p.complete(prompt2, 1, d1.params.for_prefill_hit(), timeout=30)
    confirm_counter_rose(
        "P's failed transfers", lambda: pair.p.metrics().value(FAILED), p0.value(FAILED)
    )  # the READ did fail
    dp = pair.p.metrics() - p0
    assert dp.value(FAILED) == 1
    if policy == "fail":
        assert pr.status == 500
    else:
        assert pr.ok and pr.params is not None
        assert sources(dp)["local_compute"] == len(prompt2)
        assert sources(dp)["external_kv_transfer"] == 0


def test_handles_are_single_use(engine_pair: Factory) -> None:
    """A second read of D's consumed handle is refused, never silently served
    (docs/protocol.md §15.5)."""
    pair = engine_pair(prefill=NO_P_CACHE)
    rng, prompt, d1 = _history(pair, "single-use")
    prompt2 = [*prompt, *d1.token_ids, *random_prompt(rng, 50)]
    hit = d1.params.for_prefill_hit()
    p0 = pair.p.metrics()
    first = pair.p.complete(prompt2, 1, hit)
    assert first.ok
    assert sources(pair.p.metrics() - p0)["external_kv_transfer"] == 307
    wait_for(lambda: pair.state("d")["retained"] == 0)
    p1 = pair.p.metrics()
    second = pair.p.complete(prompt2, 1, hit)
    dp = pair.p.metrics() - p1
    assert second.status == 500  # default policy fail
    assert dp.value(FAILED) == 1 and dp.value(XFERS) == 0


def test_p_holds_blocks_under_lease_until_d_reads_or_it_lapses(engine_pair: Factory) -> None:
    """No D ever reads: P releases its prefilled blocks when the lease lapses
    (docs/protocol.md §8)."""
    pair = engine_pair(prefill_kv={"kv_lease_duration": 6})
    mark = pair.p.log_mark()
    p0 = pair.p.metrics()
    pr = pair.prefill(random_prompt(random.Random("lease"), 64), None)
    assert pr.ok and pr.params is not None
    assert pair.state("p")["leased"] == 1
    wait_for(lambda: pair.state("p")["leased"] == 0, timeout=15)
    assert (pair.p.metrics() - p0).value(EXPIRED) == 1
    assert f"Releasing expired KV blocks for request {pr.params.remote_request_id}" in (
        pair.p.log_since(mark)
    )


def test_dropped_notification_leaves_d_blocks_to_the_ttl(engine_pair: Factory) -> None:
    # D keeps its blocks 8 s but exports a deadline 20 s later, so P still reads
    pair = engine_pair(prefill=NO_P_CACHE, decode_kv={"decoder_kv_blocks_ttl": 8.0})
    pair.set_faults("d", drop_notifications=1.0, clock_skew=20.0)
    rng, prompt, d1 = _history(pair, "drop")
    prompt2 = [*prompt, *d1.token_ids, *random_prompt(rng, 50)]
    d0 = pair.d.metrics()
    assert pair.p.complete(prompt2, 1, d1.params.for_prefill_hit()).ok
    assert pair.state("d")["retained"] == 1
    wait_for(lambda: pair.state("d")["retained"] == 0, timeout=20)
    assert (pair.d.metrics() - d0).value(EXPIRED) == 1


def test_exit_after_streamed_tokens_truncates_the_stream(engine_pair: Factory) -> None:
    pair = engine_pair()
    pair.set_faults("d", exit_after_tokens=3)
    prompt = random_prompt(random.Random("exit"), 40)
    pr = pair.prefill(prompt, None)
    assert pr.params is not None
    with pytest.raises(StreamCut) as cut:  # never a [DONE]
        pair.d.complete(prompt, 10, pr.params, stream=True, timeout=30)
    assert cut.value.partial.chunks == 3 and cut.value.partial.finish_reason is None
    proc = pair.topo.process("decode-0")
    wait_for(lambda: proc.returncode is not None)
    assert proc.returncode == 3


def test_exit_on_nth_request(engine_pair: Factory) -> None:
    pair = engine_pair()
    pair.set_faults("p", exit_on_request=2)
    prompt = random_prompt(random.Random("exit-n"), 20)
    assert pair.p.complete(prompt, 1).ok
    with pytest.raises(TransportError):  # the process is gone before it answers
        pair.p.complete(prompt, 1, timeout=10)
    proc = pair.topo.process("prefill-0")
    wait_for(lambda: proc.returncode is not None)


def test_p_with_bidirectional_off_ignores_d_params_without_hanging(engine_pair: Factory) -> None:
    """Suspected upstream defect 2: vLLM's P may wait forever; ours recomputes."""
    pair = engine_pair(prefill_kv={"bidirectional_kv_xfer": False})
    rng, prompt, d1 = _history(pair, "p-off")
    prompt2 = [*prompt, *d1.token_ids, *random_prompt(rng, 200)]
    p0 = pair.p.metrics()
    pr = pair.p.complete(prompt2, 1, d1.params.for_prefill_hit(), timeout=30)
    assert pr.ok
    assert sources(pair.p.metrics() - p0)["external_kv_transfer"] == 0


def test_d_with_bidirectional_off_returns_no_params(engine_pair: Factory) -> None:
    pair = engine_pair(decode_kv={"bidirectional_kv_xfer": False})
    prompt = random_prompt(random.Random("d-off"), 50)
    for stream in (False, True):
        pr, dr = pair.turn(prompt, 4, stream=stream)
        assert pr.params is not None and dr is not None and dr.ok
        assert dr.params is None
    assert pair.state("d")["retained"] == 0


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_d_gone_between_turns_follows_failure_policy(engine_pair: Factory, policy: str) -> None:
    """A real (not injected) failure: D's process is gone when P tries to read from it."""
    pair = engine_pair(prefill=NO_P_CACHE, prefill_kv={"kv_load_failure_policy": policy})
    rng, prompt, d1 = _history(pair, f"d-gone-{policy}")
    stop_process(pair.topo.process("decode-0"))
    prompt2 = [*prompt, *d1.token_ids, *random_prompt(rng, 50)]
    p0 = pair.p.metrics()
    pr = pair.p.complete(prompt2, 1, d1.params.for_prefill_hit(), timeout=60)
    confirm_counter_rose(
        "P's failed transfers", lambda: pair.p.metrics().value(FAILED), p0.value(FAILED)
    )  # the READ from the dead D did fail
    dp = pair.p.metrics() - p0
    assert dp.value(FAILED) == 1
    if policy == "fail":
        assert pr.status == 500
    else:
        assert pr.ok and sources(dp)["local_compute"] == len(prompt2)


def test_stall_freezes_scheduling_but_not_health(engine_pair: Factory) -> None:
    from concurrent.futures import ThreadPoolExecutor

    pair = engine_pair()
    pair.set_faults("p", stall=True)
    prompt = random_prompt(random.Random("stall"), 32)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(pair.p.complete, prompt, 4)
        wait_for(lambda: pair.state("p")["running"] == 1)
        assert fetch(pair.p.url + "/health", timeout=10).status == 200
        assert not pending.done()
        pair.set_faults("p", stall=False)
        assert pending.result(timeout=30).ok
