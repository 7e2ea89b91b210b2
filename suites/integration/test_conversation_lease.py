"""The renewable decode-side lease through a real router and emulated engines.

D runs with ``kv_connector_extra_config.bidir_kv_lease_seconds`` (as our vLLM
connector's D does), so it advertises ``bidir_kv_lease`` in its dict and the router
manages the lease: a keep-alive holds a conversation past the idle lease, an idle one
is dropped and D's blocks freed, ``DELETE /v1/conversations/{id}`` frees them at once.
D's retained turns are read from ``/_emulator/state``; D's own TTL (480 s) never
fires here, so every drop seen is the router's release.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bidir_kv.client import fetch, get_json
from bidir_kv.testing.engines import kv_config
from bidir_kv.testing.poll import wait_for
from bidir_kv.testing.router import (
    RouterProcess,
    chat,
    conversation_id,
    long_opening,
    router_counter,
)
from bidir_kv.topology.base import EngineSpec, TopologySpec

LEASE = 3.0  # D's advertised idle lease, seconds


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from bidir_kv.topology.local import LocalTopology

    spec = TopologySpec(
        routers=0,
        prefill=EngineSpec(kv=kv_config("prefill"), transport="tcp", enable_prefix_caching=False),
        decode=EngineSpec(kv=kv_config("decode", bidir_kv_lease_seconds=LEASE), transport="tcp"),
    )
    with LocalTopology(spec, tmp_path_factory.mktemp("router-lease")) as t:
        yield t


def retained(node: Any) -> int:
    return int(get_json(node.url + "/_emulator/state")["retained"])


def call(url: str, method: str, path: str) -> tuple[int, dict[str, Any]]:
    reply = fetch(url + path, method=method, content=b"" if method == "POST" else None)
    return reply.status, reply.json_object()


def start(topo: Any, router_process: Callable[..., RouterProcess], *flags: str) -> RouterProcess:
    return router_process(
        [(n.host, n.port) for n in topo.prefill],
        [(n.host, n.port) for n in topo.decode],
        extra=("--lease-sweep-interval", "0.2", *flags),
    )


def second_turn(first: Any, tag: str) -> list[dict[str, Any]]:
    return [
        *long_opening(tag),
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And then?"},
    ]


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_delete_frees_ds_blocks_at_once_and_next_turn_misses(
    topo: Any,
    router_process: Callable[..., RouterProcess],
    store: str,
    request: pytest.FixtureRequest,
) -> None:
    """The router's own --conversation-lease (600 s) overrides D's 3 s, so only the
    DELETE can free the blocks; the next turn is a miss, answered in full."""
    spec = "memory"
    if store == "redis":
        spec = request.getfixturevalue("redis_server").url
    d = topo.decode[0]
    rp = start(topo, router_process, "--conversation-lease", "600", "--store", spec)
    before = retained(d)
    conv = conversation_id("close")
    first = chat(rp.url, long_opening(conv), conv)
    assert first.status == 200 and first.error is None, first.raw[:300]
    assert retained(d) == before + 1
    status, body = call(rp.url, "DELETE", f"/v1/conversations/{conv}")
    assert (status, body["deleted"]) == (200, True), body
    wait_for(lambda: retained(d) == before, 15, "D to free the closed conversation's blocks")
    # counted when P has answered the release, which can be after D freed the blocks
    wait_for(
        lambda: router_counter(rp.url, "releases", reason="closed") == 1,
        15,
        "the router to count its release",
    )
    assert call(rp.url, "DELETE", f"/v1/conversations/{conv}")[0] == 404
    nxt = chat(rp.url, second_turn(first, conv), conv)
    assert nxt.status == 200 and nxt.error is None and nxt.text
    assert router_counter(rp.url, "cache_misses", reason="not_found") == 2
    assert router_counter(rp.url, "cache_hit_offers") == 0


def test_keepalive_holds_past_the_idle_lease_and_idle_expiry_frees(
    topo: Any, router_process: Callable[..., RouterProcess]
) -> None:
    """Two conversations on D's advertised 3 s lease: one kept alive, one left idle.
    The idle one's blocks are freed by the router (D's TTL is 480 s); the kept one is
    still a hit more than one lease after its turn."""
    d = topo.decode[0]
    rp = start(topo, router_process)
    before = retained(d)
    kept, idle = conversation_id("kept"), conversation_id("idle")
    other = chat(rp.url, long_opening(idle), idle)  # first: the kept one is always fresher
    t0 = time.monotonic()
    first = chat(rp.url, long_opening(kept), kept)
    assert first.status == other.status == 200
    assert retained(d) == before + 2

    def kept_alive_and_idle_gone() -> bool:
        status, body = call(rp.url, "POST", f"/v1/conversations/{kept}/keepalive")
        assert status == 200 and body["lease_seconds"] == LEASE, body
        return retained(d) == before + 1

    wait_for(kept_alive_and_idle_gone, 30, "the idle conversation's lease to expire", interval=0.3)
    assert router_counter(rp.url, "lease_expiries") == 1
    wait_for(  # counted when P has answered the release, which can be after D freed
        lambda: router_counter(rp.url, "releases", reason="lease_expired") == 1,
        15,
        "the router to count its release",
    )
    assert call(rp.url, "POST", f"/v1/conversations/{idle}/keepalive")[0] == 404
    assert time.monotonic() - t0 > LEASE
    hit = chat(rp.url, second_turn(first, kept), kept)
    assert hit.status == 200 and hit.error is None
    assert router_counter(rp.url, "cache_hits") == 1
    assert router_counter(rp.url, "conversation_keepalives", outcome="renewed") >= 1


def test_unknown_and_bad_ids(topo: Any, router_process: Callable[..., RouterProcess]) -> None:
    rp = start(topo, router_process)
    status, body = call(rp.url, "DELETE", "/v1/conversations/never-seen")
    assert status == 404 and "never-seen" in body["error"]["message"]
    status, body = call(rp.url, "POST", "/v1/conversations/" + "x" * 513 + "/keepalive")
    assert status == 400 and "longer than 512" in body["error"]["message"]


async def test_redis_store_lease_clock(redis_server: Any) -> None:
    """Keep-alive, expiry and close on the Redis store (atomic scripts), on a fake clock."""

    from bidir_kv.protocol import KVTransferParams
    from bidir_kv.router.store import Entry, RedisStore, Renewal

    params = KVTransferParams.build(
        do_remote_decode=True,
        remote_block_ids=[[1]],
        remote_engine_id="d",
        remote_request_id="r",
        remote_host="h",
        remote_port=1,
        remote_num_tokens=9,
    )

    def entry(created: float, lease: float | None) -> Entry:
        return Entry(params=params, decode="d:1", prefill=None, created=created, lease=lease)

    now = [1000.0]
    store = RedisStore(
        redis_server.url,
        ttl=100,
        max_entries=10,
        now=lambda: now[0],
        prefix=f"lease{time.monotonic_ns()}:",
    )
    dropped: list[str] = []
    store.on_evict = lambda _e, why: dropped.append(why)
    try:
        await store.put("t/a", entry(now[0], 10.0))
        await store.put("t/fixed", entry(now[0], None))
        now[0] += 9.0
        assert await store.expire_leases() == 0
        assert await store.renew("t/a") == Renewal(10.0, 1019.0)
        assert await store.renew("t/fixed") == Renewal(None, None)
        assert await store.renew("t/unknown") is None
        now[0] += 9.0
        assert await store.expire_leases() == 0
        now[0] += 1.0
        assert await store.expire_leases() == 1 and dropped == ["lease_expired"]
        assert await store.renew("t/a") is None and await store.size() == 1
        await store.put("t/b", entry(now[0], 5.0))
        assert (await store.take("t/b")).entry is not None
        assert await store.renew("t/b") is None  # ZADD XX: a taken entry stays gone
        now[0] += 10.0
        assert await store.expire_leases() == 0
        assert await store.end("t/fixed") and not await store.end("t/fixed")
        assert dropped == ["lease_expired", "closed"]
        await store.put("t/old", entry(now[0] - 101.0, 500.0))
        assert await store.renew("t/old") is None  # stale: past the hard cap
    finally:
        await store.close()
