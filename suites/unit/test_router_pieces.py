"""Unit tests of the router's pure pieces: identity, SSE byte helpers, guard, relay, store."""

from __future__ import annotations

import json

import pytest

from bidir_kv.policy import KVGroup, cache_ttl_within_retention, entry_is_stale
from bidir_kv.protocol import KVTransferParams, ProtocolError
from bidir_kv.router.failures import Cause, Leg, UpstreamFailure, failure_label
from bidir_kv.router.guard import judge_continuation, release_params
from bidir_kv.router.identity import (
    ANONYMOUS_TENANT,
    IdentityError,
    cache_salt_for,
    conversation_key,
    log_safe,
    path_conversation_key,
    tenant_digest,
)
from bidir_kv.router.relay import StreamRelay, synthesize_sse
from bidir_kv.router.sse import event_end, strip_null_params, take_int_list, untracked_delta
from bidir_kv.router.store import Entry, MemoryStore
from bidir_kv.wire.params import groups_to_wire

D_PARAMS = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[7, 8, 9]],
    "remote_engine_id": "d",
    "remote_request_id": "cmpl-d-1",
    "remote_host": "10.0.0.2",
    "remote_port": 5700,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 40,
    "remote_blocks_expiry_time": 838.0,
    "transfer_mode": "pull",
}


# ---- identity -------------------------------------------------------------------


def test_body_conversation_id_wins_and_is_removed() -> None:
    body = {"conversation_id": "c1", "prompt_cache_key": "k", "model": "m"}
    key = conversation_key(body, {"X-Session-ID": "s", "Authorization": "Bearer a"})
    assert key is not None and key.conversation_id == "c1" and key.source == "conversation_id"
    assert "conversation_id" not in body and body["prompt_cache_key"] == "k"


def test_header_then_prompt_cache_key() -> None:
    assert conversation_key({}, {"X-Session-ID": "s"}).conversation_id == "s"  # type: ignore[union-attr]
    key = conversation_key({"prompt_cache_key": "k"}, {})
    assert key is not None and key.source == "prompt_cache_key"
    assert conversation_key({"conversation_id": ""}, {}) is None


def test_tenants_are_isolated() -> None:
    a = conversation_key({"conversation_id": "c"}, {"Authorization": "Bearer alice"})
    b = conversation_key({"conversation_id": "c"}, {"Authorization": "Bearer bob"})
    anon = conversation_key({"conversation_id": "c"}, {})
    assert a and b and anon
    assert len({a.storage_key, b.storage_key, anon.storage_key}) == 3
    assert anon.tenant == ANONYMOUS_TENANT
    assert "alice" not in a.storage_key


def test_bad_conversation_id_is_an_error() -> None:
    with pytest.raises(IdentityError, match="conversation_id must be a string"):
        conversation_key({"conversation_id": 5}, {})
    with pytest.raises(IdentityError, match="longer than"):
        conversation_key({"conversation_id": "x" * 600}, {})


def test_conversation_id_length_limit_and_error_names() -> None:
    assert conversation_key({"conversation_id": "x" * 512}, {}) is not None  # the limit itself
    with pytest.raises(IdentityError, match="must be a string, got int"):
        conversation_key({"conversation_id": 5}, {})
    with pytest.raises(IdentityError, match=r"^X-Session-ID header is longer than 512"):
        conversation_key({}, {"X-Session-ID": "s" * 513})
    with pytest.raises(IdentityError, match=r"^prompt_cache_key must be a string"):
        conversation_key({"prompt_cache_key": 7}, {})
    key = conversation_key({}, {"X-Session-ID": "s"})
    assert key is not None and key.source == "X-Session-ID"


def test_tenant_digest_is_stable_and_takes_any_header_text() -> None:
    # a store entry outlives a deploy (Redis): the digest must not change between versions
    assert tenant_digest("Bearer alice") == "9d7cce461e4b2f090a3d686b"
    assert tenant_digest(None) == tenant_digest("") == ANONYMOUS_TENANT
    # aiohttp decodes a header's non-UTF-8 bytes as lone surrogates: still one tenant each
    odd = tenant_digest("Bearer \udcff")
    assert len(odd) == 24 and odd != tenant_digest("Bearer \udcfe")


def test_cache_salt_per_tenant_none_for_anonymous() -> None:
    assert cache_salt_for(ANONYMOUS_TENANT) is None
    assert cache_salt_for("9d7cce461e4b2f090a3d686b") == "tenant-9d7cce461e4b2f090a3d686b"


def test_path_conversation_key_is_the_callers_tenant() -> None:
    key = path_conversation_key("c1", {"Authorization": "Bearer alice"})
    assert (key.tenant, key.conversation_id, key.source) == (
        tenant_digest("Bearer alice"),
        "c1",
        "path",
    )
    assert (
        key.storage_key
        == conversation_key(
            {"conversation_id": "c1"}, {"Authorization": "Bearer alice"}
        ).storage_key
    )  # type: ignore[union-attr]
    with pytest.raises(IdentityError, match=r"^the conversation id in the path is empty$"):
        path_conversation_key("", {})
    with pytest.raises(IdentityError, match=r"^the conversation id in the path is longer"):
        path_conversation_key("x" * 513, {})


def test_log_safe_escapes_what_could_forge_a_line_and_cuts() -> None:
    assert log_safe("conv-1") == "conv-1"
    assert log_safe("a\nforged line") == "a\\nforged line"
    assert log_safe("a\\nb") == "a\\\\nb"  # a literal backslash-n cannot pass for an escape
    assert log_safe("caf\u00e9") == "caf\u00e9"  # printable text is kept as it is
    assert log_safe("x" * 200) == "x" * 200
    assert log_safe("x" * 201) == "x" * 200 + "..."
    assert log_safe("abcdef", limit=3) == "abc..."


# ---- SSE byte helpers -------------------------------------------------------------


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content", "tool_calls", "function_call"])
def test_untracked_delta_detects_each_key(key: str) -> None:
    value = (
        [{"index": 0}]
        if key == "tool_calls"
        else {"name": "f"}
        if key == "function_call"
        else "think"
    )
    chunk = json.dumps({"choices": [{"delta": {key: value}}]}).encode()
    assert untracked_delta(chunk) == key


def test_untracked_delta_ignores_empty_values_and_content_text() -> None:
    assert untracked_delta(b'{"choices":[{"delta":{"tool_calls":[],"reasoning":null}}]}') is None
    text = json.dumps({"choices": [{"delta": {"content": 'say "reasoning": yes'}}]}).encode()
    assert untracked_delta(text) is None


def test_take_int_list_extracts_and_removes() -> None:
    raw = b'{"choices":[{"index":0,"token_ids":[5, 6,7],"text":"x"}],"prompt_token_ids":[1,2]}'
    ids, out = take_int_list(raw, b"token_ids", remove=True)
    assert ids == [5, 6, 7]
    assert json.loads(out) == {"choices": [{"index": 0, "text": "x"}], "prompt_token_ids": [1, 2]}
    pids, out2 = take_int_list(out, b"prompt_token_ids", remove=True)
    assert pids == [1, 2] and json.loads(out2) == {"choices": [{"index": 0, "text": "x"}]}
    first, out3 = take_int_list(b'{"token_ids":[1],"a":2}', b"token_ids", remove=True)
    assert first == [1] and json.loads(out3) == {"a": 2}


def test_strip_null_params_forms() -> None:
    assert strip_null_params(b'{"a":1,"kv_transfer_params":null}') == b'{"a":1}'
    assert json.loads(strip_null_params(b'{"kv_transfer_params": null, "a": 1}') or b"") == {"a": 1}
    assert strip_null_params(b'{"kv_transfer_params":{"x":1}}') is None


def test_event_end() -> None:
    assert event_end(b"data: x\n\ndata: y") == (7, 2)
    assert event_end(b"data: x\r\n\r\n") == (7, 4)
    assert event_end(b"data: x\n") == (-1, 0)


# ---- relay ------------------------------------------------------------------------


def _chunk(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode()


def test_relay_captures_terminal_params_and_strips_them() -> None:
    relay = StreamRelay(keep_params=False, collect_ids=True, strip_ids=True)
    first = _chunk(
        {
            "choices": [{"delta": {"content": "a"}, "finish_reason": None, "token_ids": [97]}],
            "prompt_token_ids": [1, 2, 3],
            "kv_transfer_params": None,
        }
    )
    last = _chunk(
        {
            "choices": [{"delta": {"content": "b"}, "finish_reason": "length", "token_ids": [98]}],
            "kv_transfer_params": D_PARAMS,
        }
    )
    out1 = relay.process_event(first, b"\n\n")
    out2 = relay.process_event(last, b"\n\n")
    relay.process_event(b"data: [DONE]", b"\n\n")
    assert b"kv_transfer_params" not in out1 + out2
    assert b"token_ids" not in out1 + out2
    assert json.loads(out2[6:])["choices"][0]["finish_reason"] == "length"
    result = relay.result
    assert result.params is not None and result.params.remote_request_id == "cmpl-d-1"
    assert result.tokens() == [1, 2, 3, 97, 98] and result.done and result.untracked is None


def test_relay_captures_params_from_a_chunk_of_their_own() -> None:
    """D may send its params in a chunk after the one carrying finish_reason."""
    relay = StreamRelay(keep_params=False, collect_ids=False, strip_ids=False)
    last = _chunk(
        {
            "choices": [{"delta": {"content": "b"}, "finish_reason": "length"}],
            "kv_transfer_params": None,
        }
    )
    own = _chunk({"choices": [], "kv_transfer_params": D_PARAMS})
    out = relay.process_event(last, b"\n\n") + relay.process_event(own, b"\n\n")
    relay.process_event(b"data: [DONE]", b"\n\n")
    assert b"kv_transfer_params" not in out
    result = relay.result
    assert result.finish_reason == "length"
    assert result.params is not None and result.params.remote_request_id == "cmpl-d-1"


def test_relay_forwards_plain_chunks_byte_for_byte() -> None:
    relay = StreamRelay(keep_params=False, collect_ids=False, strip_ids=False)
    ev = _chunk({"choices": [{"delta": {"content": " lorem"}, "finish_reason": None}]})
    assert relay.process_event(ev, b"\n\n") is not None
    assert relay.process_event(ev, b"\n\n") == ev + b"\n\n"


def test_relay_keep_params_leaves_terminal_chunk() -> None:
    relay = StreamRelay(keep_params=True, collect_ids=False, strip_ids=False)
    last = _chunk(
        {"choices": [{"delta": {}, "finish_reason": "stop"}], "kv_transfer_params": D_PARAMS}
    )
    assert relay.process_event(last, b"\n\n") == last + b"\n\n"
    assert relay.result.params is not None


def test_synthesize_sse_chat_with_usage() -> None:
    body = {
        "id": "x",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi", "tool_calls": []},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {"total_tokens": 3},
    }
    events = [e for e in synthesize_sse(body, "chat/completions", True).split(b"\n\n") if e]
    chunk = json.loads(events[0][6:])
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": "hi"}
    assert json.loads(events[1][6:])["usage"] == {"total_tokens": 3}
    assert events[-1] == b"data: [DONE]"


# ---- guard -------------------------------------------------------------------------


def test_guard_accepts_exact_continuation() -> None:
    p = KVTransferParams.parse(D_PARAMS)  # r = 40
    d = list(range(41))
    v = judge_continuation(p, d, [*d[:40], 999, 1000], block_size=16)
    assert v.accepted and v.params == p and v.reason == "continuation"


def test_guard_rejects_mismatch_without_block_size_and_trims_with_it() -> None:
    p = KVTransferParams.parse(D_PARAMS)
    d = list(range(41))
    changed = [*d[:20], 555, *d[21:40], 1]
    assert not judge_continuation(p, d, changed, block_size=None).accepted
    v = judge_continuation(p, d, changed, block_size=16)
    assert v.accepted and v.params is not None
    assert v.params.remote_num_tokens == 16 and v.params.remote_block_ids == [[7]]
    assert v.reason == "trimmed-mismatch"


def test_guard_rejects_shorter_prompt_and_unverifiable() -> None:
    p = KVTransferParams.parse(D_PARAMS)
    d = list(range(41))
    assert judge_continuation(p, d, d[:30], block_size=None).reason == "shorter-prompt"
    assert judge_continuation(p, None, d, block_size=16).reason == "unverifiable"
    assert judge_continuation(p, d[:10], d, block_size=16).reason == "unverifiable"


def test_guard_boundaries_nothing_held_one_token_and_exact_lengths() -> None:
    p = KVTransferParams.parse(D_PARAMS)  # r = 40
    d = list(range(40))
    nothing = judge_continuation(p.with_fields(remote_num_tokens=0), None, d, block_size=16)
    assert nothing.params is not None and nothing.params.num_remote_tokens == 0
    assert (nothing.reason, nothing.reusable_tokens) == ("nothing-to-reuse", 0)
    one = judge_continuation(p.with_fields(remote_num_tokens=1), [5], [5, 6], block_size=16)
    assert (one.reason, one.reusable_tokens) == ("continuation", 1)
    # D's sequence and the prompt exactly r long: a continuation, all r reusable
    exact = judge_continuation(p, d, d, block_size=16)
    assert exact.accepted and (exact.reason, exact.reusable_tokens) == ("continuation", 40)
    # a prompt as long as r that differs is a mismatch, not a shorter prompt
    other = [*d[:39], 999]
    assert judge_continuation(p, d, other, block_size=None).reason == "mismatch"


def test_guard_trim_counts_whole_blocks_up_to_ds_list() -> None:
    p = KVTransferParams.parse(D_PARAMS)  # r = 40 over blocks [7, 8, 9]
    d = list(range(41))
    v = judge_continuation(p, d, [*d[:20], 555, *d[21:40]], block_size=16)
    assert (v.reason, v.reusable_tokens) == ("trimmed-mismatch", 16)
    # the whole of D's (short) list reusable: kept, not refused
    two = p.with_fields(remote_block_ids=[[7, 8]])
    v = judge_continuation(two, d, [*d[:35], 555, *d[36:40]], block_size=16)
    assert v.params is not None and v.params.remote_block_ids == [[7, 8]]
    assert (v.reason, v.reusable_tokens) == ("trimmed-mismatch", 32)
    # a change inside the first block leaves no whole block: refused
    v = judge_continuation(p, d, [555, *d[1:40]], block_size=16)
    assert (v.params, v.reason) == (None, "mismatch")


def test_guard_trims_several_kv_cache_groups_only_with_their_layout() -> None:
    """A hybrid D (full + sliding window of 40 tokens, block size 16) held 200 tokens:
    13 full-attention blocks, and of the window group the exported tail, block 9 freed
    (docs/protocol.md §6.4). A stock D says nothing of its groups: a continuation passes
    untrimmed, a cut is refused; our D's layout lets the guard cut where the window
    allows, and refuse where D freed what the window needs."""
    d = list(range(1000, 1201))
    two = {**D_PARAMS, "remote_num_tokens": 200}
    two["remote_block_ids"] = [list(range(1, 14)), [0, 24, 25, 26]]
    p = KVTransferParams.parse(two)
    exact = judge_continuation(p, d, [*d, 5], block_size=16)
    assert exact.accepted and exact.params == p and exact.reason == "continuation"
    edited = [*d[:195], *range(5, 15)]  # the reply rewritten after token 195: 192 reusable
    assert judge_continuation(p, d, edited, block_size=16).reason == "unknown-group-layout"
    narrow = p.with_fields(
        bidir_kv_groups=groups_to_wire([KVGroup.full(16), KVGroup.sliding(40, 16)])
    )
    v = judge_continuation(narrow, d, edited, block_size=16)
    assert (v.params, v.reason) == (None, "sliding-window-released")
    wide_ids = [list(range(1, 14)), list(range(18, 27))]  # blocks 4-12 of the window
    wide = p.with_fields(
        remote_block_ids=wide_ids,
        bidir_kv_groups=groups_to_wire([KVGroup.full(16), KVGroup.sliding(128, 16)]),
    )
    v = judge_continuation(wide, d, edited, block_size=16)
    assert (
        v.accepted
        and v.params is not None
        and (v.reason, v.reusable_tokens)
        == (
            "trimmed-mismatch",
            192,
        )
    )
    assert v.params.remote_num_tokens == 192
    # D's lists as D would have exported them at 192 tokens: block 3 is before its tail
    assert v.params.remote_block_ids == [list(range(1, 13)), [0, *range(18, 26)]]
    # nothing whole in common stays the plain reason, whatever the groups
    assert judge_continuation(wide, d, [5, *d[1:]], block_size=16).reason == "mismatch"


def test_with_remote_host_is_with_fields_without_revalidation() -> None:
    p = KVTransferParams.parse(D_PARAMS)
    assert p.with_remote_host("10.1.1.1") == p.with_fields(remote_host="10.1.1.1")
    assert p.with_remote_host("h").to_dict() == {**D_PARAMS, "remote_host": "h"}
    miss = KVTransferParams.parse({"do_remote_decode": True})
    assert miss.with_remote_host("h").to_dict() == {"do_remote_decode": True, "remote_host": "h"}
    with pytest.raises(ProtocolError, match="remote_host"):
        p.with_remote_host(5)  # type: ignore[arg-type]


def test_release_params_make_p_count_zero() -> None:
    rel = release_params(KVTransferParams.parse(D_PARAMS))
    assert rel.num_remote_tokens == 0 and rel.is_valid_remote and rel.do_remote_decode


# ---- memory store ---------------------------------------------------------------------


def _entry(t: float, tokens: list[int] | None = None) -> Entry:
    return Entry(KVTransferParams.parse(D_PARAMS), "d:1", "p:1", t, tokens)


async def test_memory_store_single_use_ttl_and_lru() -> None:
    now = [100.0]
    store = MemoryStore(ttl=10, max_entries=2, now=lambda: now[0])
    await store.put("a", _entry(100.0))
    taken = await store.take("a")
    assert taken.entry is not None and taken.age == 0
    assert (await store.take("a")).entry is None  # single use
    await store.put("b", _entry(100.0))
    now[0] = 111.0
    stale = await store.take("b")
    assert stale.entry is None and stale.stale and stale.age == pytest.approx(11)
    for k in ("c", "d", "e"):
        await store.put(k, _entry(now[0]))
    assert await store.size() == 2 and store.evicted_lru == 1
    assert (await store.take("c")).entry is None
    now[0] = 200.0
    assert await store.sweep() == 2 and await store.size() == 0


async def test_memory_store_reports_every_entry_it_drops_with_the_reason() -> None:
    now = [100.0]
    store = MemoryStore(ttl=10, max_entries=1, now=lambda: now[0])
    dropped: list[tuple[float, str]] = []
    store.on_evict = lambda e, why: dropped.append((e.created, why))
    await store.put("a", _entry(100.0))
    await store.put("a", _entry(101.0))  # the same conversation again: the first replaced
    await store.put("b", _entry(102.0))  # over the bound: the oldest evicted
    await store.put("c", _entry(103.0))
    assert dropped == [(100.0, "replaced"), (101.0, "evicted"), (102.0, "evicted")]
    assert store.evicted_lru == 2
    now[0] = 120.0
    assert (await store.take("c")).stale and store.evicted_stale == 1
    await store.put("d", _entry(105.0))
    assert await store.sweep() == 1 and store.evicted_stale == 2
    assert dropped[-2:] == [(103.0, "stale"), (105.0, "stale")]
    taken = await store.take("d")  # swept: gone, not a stale entry any more
    assert taken.entry is None and not taken.stale


async def test_memory_store_close_wins_over_the_turn_in_flight() -> None:
    now = [100.0]
    store = MemoryStore(ttl=10, max_entries=4, now=lambda: now[0])
    await store.put("a", _entry(100.0))
    started = now[0]
    assert (await store.take("a")).entry is not None  # the turn starts
    assert await store.end("a")  # closed while the turn runs (no entry, a turn in flight)
    assert not await store.put("a", _entry(101.0), since=started)  # its store is refused
    assert (await store.take("a")).entry is None
    now[0] = 101.0
    assert await store.end("b") is False  # neither an entry nor a turn
    assert not await store.put("b", _entry(101.0), since=101.0)  # closed at the turn's start
    assert await store.put("b", _entry(102.0), since=101.5)  # a turn that began after
    assert await store.put("a", _entry(102.0))  # no start given: stored


async def test_memory_store_remembers_a_close_during_a_turn_that_found_nothing() -> None:
    now = [100.0]
    store = MemoryStore(ttl=10, max_entries=4, now=lambda: now[0])
    started = now[0]
    assert (await store.take("a")).entry is None  # turn 1: nothing stored yet
    now[0] = 100.5
    assert await store.end("a")  # a turn is in flight: the close is answered, not 404
    now[0] = 101.0
    assert not await store.put("a", _entry(101.0), since=started)  # the turn stores nothing
    assert (await store.take("a")).entry is None


def test_entry_round_trip() -> None:
    e = _entry(5.5, [1, 2, 70000])
    back = Entry.from_bytes(e.to_bytes())
    assert back.params.to_dict() == D_PARAMS and list(back.tokens or []) == [1, 2, 70000]
    assert (back.decode, back.prefill, back.created) == ("d:1", "p:1", 5.5)


def test_relay_handles_non_compact_json_too() -> None:
    """vLLM sends compact JSON (fast path); other servers may not."""
    relay = StreamRelay(keep_params=False, collect_ids=True, strip_ids=True)
    plain = (
        b"data: "
        + json.dumps(
            {
                "choices": [{"delta": {"content": "a"}, "finish_reason": None, "token_ids": [97]}],
                "prompt_token_ids": [1, 2],
                "kv_transfer_params": None,
            }
        ).encode()
    )
    last = (
        b"data: "
        + json.dumps(
            {
                "choices": [{"delta": {}, "finish_reason": "stop", "token_ids": [98]}],
                "kv_transfer_params": D_PARAMS,
            }
        ).encode()
    )
    out = relay.process_event(plain, b"\n\n") + relay.process_event(last, b"\n\n")
    assert b"kv_transfer_params" not in out and b"token_ids" not in out
    result = relay.result
    assert result.params is not None and result.finish_reason == "stop"
    assert result.tokens() == [1, 2, 97, 98]
    assert [json.loads(e[6:]) for e in out.split(b"\n\n") if e] == [
        {"choices": [{"delta": {"content": "a"}, "finish_reason": None}]},
        {"choices": [{"delta": {}, "finish_reason": "stop"}]},
    ]


def test_staleness_rule_fresh_at_the_ttl_stale_after_and_below_d_retention() -> None:
    assert not entry_is_stale(created=100.0, now=110.0, ttl=10.0)  # exactly ttl old: fresh
    assert entry_is_stale(created=100.0, now=110.5, ttl=10.0)
    assert not entry_is_stale(created=120.0, now=110.0, ttl=10.0)  # clock stepped back
    assert cache_ttl_within_retention(450.0, 480.0)
    assert not cache_ttl_within_retention(480.0, 480.0)


def test_leg_failure_labels_are_the_metric_strings() -> None:
    assert failure_label(Leg.PREFILL, Cause.TIMEOUT) == "prefill_timeout"
    assert failure_label(Leg.PREFILL, Cause.BAD_RESPONSE) == "prefill_bad_response"
    assert failure_label(Leg.DECODE, Cause.UNREACHABLE) == "decode_unreachable"
    assert failure_label(Leg.DECODE, Cause.MID_STREAM) == "decode_mid_stream"
    assert UpstreamFailure(Cause.UNREACHABLE, "x").unreachable
    assert not UpstreamFailure(Cause.TIMEOUT, "x").unreachable
