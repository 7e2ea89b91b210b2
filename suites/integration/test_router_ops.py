"""Operational faults at ``bidir-kv proxy``: failed pulls, stalls, bursts, held blocks.

One emulated 1P2D set (real processes on loopback) is shared by the module;
each test starts routers of its own in front of some of those engines and
resets any fault it sets on an engine, even when it fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bidir_kv.client import scrape
from bidir_kv.testing.faults import confirm_counter_rose
from bidir_kv.testing.router import (
    RouterProcess,
    chat,
    conversation_id,
    emulated_router_topology,
    long_opening,
    router_counter,
)
from bidir_kv.testing.router_faults import Faults, router_for

FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers_total"


@pytest.fixture(scope="module")
def topo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with emulated_router_topology(
        request.config,
        tmp_path_factory.mktemp("router-ops"),
        num_decode=2,
        prefix_caching_on_p=False,
    ) as t:
        yield t


def oracle(topo: Any, messages: list[dict[str, Any]], max_tokens: int = 12) -> str:
    return chat(topo.prefill[0].url, messages, stream=False, max_tokens=max_tokens).text


@pytest.mark.parametrize("stream", [True, False])
def test_failed_pull_on_d_is_answered_as_a_miss(
    topo: Any,
    router_process: Callable[..., RouterProcess],
    engine_faults: Faults,
    stream: bool,
) -> None:
    """D cannot pull P's blocks (it answers 500): the client still gets the right text."""
    d = topo.decode[0]
    rp = router_for(topo, router_process, [d])
    engine_faults(d, {"fail_transfers": 1.0})
    msgs = long_opening(conversation_id("pullfail"))
    failed = scrape(d.url).value(FAILED_TRANSFERS)
    res = chat(rp.url, msgs, conversation_id("pullfail"), stream=stream)
    confirm_counter_rose(
        "D's failed transfers", lambda: scrape(d.url).value(FAILED_TRANSFERS), failed
    )  # D's pull did fail
    assert res.status == 200 and res.error is None, res.raw[:300]
    assert res.text == oracle(topo, msgs)
    assert router_counter(rp.url, "fallbacks", cause="decode_pull") == 1


async def test_redis_store_survives_200_concurrent_turns(
    topo: Any, router_process: Callable[..., RouterProcess], redis_server: Any
) -> None:
    """More turns at once than redis-py's default pool allows (100): none fails, all stored
    (the blocking pool of --max-concurrency connections makes the excess wait)."""
    import asyncio

    import aiohttp

    rp = router_for(topo, router_process, topo.decode[:1], "--store", redis_server.url)
    n = 200
    tag = conversation_id("redis-burst")

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"hi {tag} {i}"}],
            "max_tokens": 2,
            "temperature": 0,
            "conversation_id": f"{tag}-{i}",
        }
        async with session.post(rp.url + "/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.status

    async def burst() -> list[int]:
        timeout = aiohttp.ClientTimeout(total=120)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            return await asyncio.gather(*(one(session, i) for i in range(n)))

    statuses = await burst()
    assert statuses == [200] * n
    assert router_counter(rp.url, "errors", cause="store") == 0
    assert router_counter(rp.url, "cache_stores") == n


def _decode_inflight(url: str) -> float:
    from bidir_kv.client import scrape

    return scrape(url).value("bidir_kv_router_backend_inflight", role="decode")


@pytest.mark.parametrize("stream", [True, False])
def test_stalled_d_gets_a_504_within_the_decode_timeout(
    topo: Any,
    router_process: Callable[..., RouterProcess],
    engine_faults: Faults,
    stream: bool,
) -> None:
    import time

    d = topo.decode[1]
    rp = router_for(topo, router_process, [d], "--decode-timeout", "2")
    engine_faults(d, {"stall": True})
    t0 = time.monotonic()
    res = chat(
        rp.url,
        long_opening(conversation_id("stall")),
        conversation_id("stall"),
        stream=stream,
        timeout=30,
    )
    assert res.status == 504, res.raw[:300]
    assert "--decode-timeout" in res.error["message"]
    assert time.monotonic() - t0 < 15
    assert router_counter(rp.url, "errors", cause="decode_timeout") == 1


def test_client_leaving_cancels_the_d_leg(
    topo: Any,
    router_process: Callable[..., RouterProcess],
    engine_faults: Faults,
) -> None:
    """The client gives up on a stalled D: the router closes its D request at once
    (counted as client_gone), instead of waiting on D for ever."""
    import contextlib

    from bidir_kv.client import RequestTimeout
    from bidir_kv.testing.scenario import wait_for

    d = topo.decode[1]
    rp = router_for(topo, router_process, [d])
    engine_faults(d, {"stall": True})
    res = None
    with contextlib.suppress(RequestTimeout):  # the client gives up
        res = chat(
            rp.url, long_opening(conversation_id("gone")), conversation_id("gone"), timeout=2
        )
    assert res is None, "the stalled D answered"
    wait_for(
        lambda: router_counter(rp.url, "errors", cause="client_gone") == 1,
        10,
        "the router to notice the client left",
    )
    wait_for(lambda: _decode_inflight(rp.url) == 0, 10, "the D request to be closed")


def test_hits_count_only_tokens_p_actually_took(
    topo: Any, router_process: Callable[..., RouterProcess]
) -> None:
    """A real continuation counts a hit (with P's cached tokens); a rewritten history
    whose verified prefix is below P's recompute threshold (64) is offered and not
    pulled by P: offered, but not a hit. (The emulated P advertises that it checks D's
    chain, so D's dict goes to it whole and P cuts the read, not the router.)"""
    rp = router_for(topo, router_process, topo.decode[:1])
    conv = conversation_id("hitcount")
    msgs = long_opening(conv)
    first = chat(rp.url, msgs, conv)
    assert first.status == 200
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Go on."},
    ]
    second = chat(rp.url, msgs2, conv)
    assert second.status == 200 and second.text == oracle(topo, msgs2)
    assert router_counter(rp.url, "cache_hits") == 1
    assert router_counter(rp.url, "cache_hit_tokens") >= 64
    # same conversation, history rewritten after its first few words
    rewritten = [
        {"role": "user", "content": "Conversation " + "zebra quartz " * 40},
        {"role": "assistant", "content": second.text},
        {"role": "user", "content": "Go on."},
    ]
    third = chat(rp.url, rewritten, conv)
    assert third.status == 200 and third.text == oracle(topo, rewritten)
    assert router_counter(rp.url, "cache_hit_offers") == 2
    assert router_counter(rp.url, "prefill_verified_offers") == 2
    assert router_counter(rp.url, "guard_trims") == 0
    assert router_counter(rp.url, "cache_hits") == 1
    assert router_counter(rp.url, "cache_misses", reason="not_pulled") == 1
