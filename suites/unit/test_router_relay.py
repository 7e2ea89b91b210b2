"""The D leg's relay (bidir_kv.router.relay) byte for byte: the pump over a stream cut
anywhere, its end (D breaking off, the client leaving, the held-back ``[DONE]``), the
rewrites of each kind of event, a non-streaming answer and the stream made from one.
D's answer and the client are in-process fakes (the router's flow over real HTTP is in
test_router_flow.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from bidir_kv.router import relay as relay_module
from bidir_kv.router.relay import StreamRelay, synthesize_sse

D_PARAMS = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[7, 8, 9]],
    "remote_engine_id": "d",
    "remote_request_id": "cmpl-d-1",
    "remote_host": "10.0.0.2",
    "remote_port": 5700,
    "remote_num_tokens": 40,
}
SEP = b"\n\n"


def data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode()


class FakeD:
    """D's streamed answer: ``readany`` hands out the chunks, then b"" (or raises ``fail``).
    Each read takes 0.25 s on the relay's clock (``clock``)."""

    def __init__(self, chunks: list[bytes], fail: BaseException | None = None) -> None:
        self.chunks = list(chunks)
        self.fail = fail
        self.reads = 0
        self.now = 100.0
        self.content = self

    def clock(self) -> float:
        return self.now

    async def readany(self) -> bytes:
        self.reads += 1
        self.now += 0.25
        if self.chunks:
            return self.chunks.pop(0)
        if self.fail is not None:
            raise self.fail
        return b""


class FakeClient:
    """The client's response: what was written, and from which write on it is gone."""

    def __init__(self, gone_after: int | None = None, eof_fails: bool = False) -> None:
        self.written: list[bytes] = []
        self.gone_after = gone_after
        self.eof_fails = eof_fails
        self.eof = False

    async def write(self, chunk: bytes) -> None:
        if self.gone_after is not None and len(self.written) >= self.gone_after:
            raise ConnectionResetError("client left")
        self.written.append(chunk)

    async def write_eof(self) -> None:
        if self.eof_fails:
            raise ConnectionResetError("client left")
        self.eof = True

    @property
    def body(self) -> bytes:
        return b"".join(self.written)


def _pieces(stream: bytes, size: int) -> list[bytes]:
    return [stream[i : i + size] for i in range(0, len(stream), size)]


async def _pump(
    monkeypatch: pytest.MonkeyPatch, d: FakeD, client: FakeClient, **kw: Any
) -> StreamRelay:
    monkeypatch.setattr(relay_module, "time", SimpleNamespace(perf_counter=d.clock))
    relay = StreamRelay(**{"keep_params": False, "collect_ids": False, "strip_ids": False, **kw})
    await relay.pump(d, client)  # type: ignore[arg-type]
    return relay


PLAIN = data(
    {"choices": [{"delta": {"content": "a"}, "finish_reason": None}], "kv_transfer_params": None}
)
LAST = data({"choices": [{"delta": {}, "finish_reason": "stop"}], "kv_transfer_params": D_PARAMS})
STREAM = b": keep-alive" + SEP + PLAIN + b"\r\n\r\n" + LAST + SEP + b"data: [DONE]" + SEP
RELAYED = (
    b": keep-alive"
    + SEP
    + data({"choices": [{"delta": {"content": "a"}, "finish_reason": None}]})
    + SEP
    + data({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    + SEP
)


@pytest.mark.parametrize("size", [1, 7, 64, len(STREAM)])
async def test_pump_relays_a_stream_cut_anywhere(
    monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    d, client = FakeD(_pieces(STREAM, size)), FakeClient()
    relay = await _pump(monkeypatch, d, client)
    assert client.body == RELAYED  # [DONE] held back until finish()
    r = relay.result
    assert r.done and r.finish_reason == "stop" and r.failure is None and not r.client_gone
    assert r.params is not None and r.params.remote_request_id == "cmpl-d-1"
    assert r.terminal_params_key is True
    assert r.upstream_seconds == pytest.approx(0.25 * d.reads) and d.reads > 1
    await relay.finish(client)  # type: ignore[arg-type]
    assert client.body == RELAYED + b"data: [DONE]" + SEP and client.eof


async def test_pump_passes_empty_events_and_a_last_event_without_separator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chunks = [PLAIN + SEP, SEP + LAST]  # an empty event, then D's last one unterminated
    d, client = FakeD(chunks), FakeClient()
    relay = await _pump(monkeypatch, d, client, keep_params=True)
    assert client.body == PLAIN + SEP + SEP + LAST + SEP
    assert relay.result.failure is None and relay.result.finish_reason == "stop"
    assert not relay.result.done  # no [DONE]: finish() sends none either
    await relay.finish(client)  # type: ignore[arg-type]
    assert client.body == PLAIN + SEP + SEP + LAST + SEP and client.eof


ERROR = (
    b'data: {"error":{"message":"decode node failed mid-stream: %s","type":"BadGateway",'
    b'"code":502}}\n\n'
)


async def test_pump_reports_a_stream_that_ends_before_the_terminal_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d, client = FakeD([PLAIN + SEP, PLAIN]), FakeClient()
    relay = await _pump(monkeypatch, d, client, keep_params=True)
    r = relay.result
    assert r.failure == "stream ended before the terminal chunk"
    assert (r.done, r.finish_reason, r.params, r.terminal_params_key) == (False, None, None, None)
    assert client.body == PLAIN + SEP + PLAIN + SEP + ERROR % r.failure.encode()
    await relay.finish(client)  # type: ignore[arg-type]
    assert client.body.endswith(ERROR % r.failure.encode() + b"data: [DONE]" + SEP)


async def test_pump_without_a_finish_reason_but_with_done_is_no_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d, client = FakeD([PLAIN + SEP + b"data: [DONE]" + SEP]), FakeClient()
    relay = await _pump(monkeypatch, d, client, keep_params=True)
    assert relay.result.failure is None and relay.result.done
    assert client.body == PLAIN + SEP


@pytest.mark.parametrize(
    ("exc", "failure"),
    [
        (aiohttp.ClientPayloadError("connection reset"), "ClientPayloadError: connection reset"),
        (TimeoutError(), "TimeoutError"),
    ],
)
async def test_pump_names_what_broke_d_off(
    monkeypatch: pytest.MonkeyPatch, exc: Exception, failure: str
) -> None:
    d, client = FakeD([PLAIN + SEP], fail=exc), FakeClient()
    relay = await _pump(monkeypatch, d, client, keep_params=True)
    assert relay.result.failure == failure
    assert client.body == PLAIN + SEP + ERROR % failure.encode()


async def test_pump_stops_reading_when_the_client_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    d, client = FakeD([PLAIN + SEP, PLAIN + SEP, LAST + SEP]), FakeClient(gone_after=1)
    relay = await _pump(monkeypatch, d, client, keep_params=True)
    assert relay.result.client_gone and d.reads == 2 and client.body == PLAIN + SEP
    assert relay.result.failure is None
    await relay.finish(client)  # type: ignore[arg-type]
    assert client.body == PLAIN + SEP and not client.eof


async def test_pump_client_gone_on_the_last_unterminated_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d, client = FakeD([PLAIN + SEP, PLAIN]), FakeClient(gone_after=1)
    relay = await _pump(monkeypatch, d, client, keep_params=True)
    assert relay.result.client_gone and relay.result.failure is None  # no error written
    assert client.body == PLAIN + SEP


async def test_finish_when_the_client_leaves_at_the_end() -> None:
    relay = StreamRelay(keep_params=False, collect_ids=False, strip_ids=False)
    relay.process_event(b"data: [DONE]", SEP)
    client = FakeClient(eof_fails=True)
    await relay.finish(client)  # type: ignore[arg-type]
    assert client.body == b"data: [DONE]" + SEP and relay.result.client_gone is True


def test_a_fresh_relay_has_learnt_nothing() -> None:
    r = StreamRelay(keep_params=False, collect_ids=True, strip_ids=False).result
    assert (r.params, r.finish_reason, r.untracked, r.failure, r.terminal_params_key) == (
        None,
        None,
        None,
        None,
        None,
    )
    assert r.client_gone is False and r.done is False and r.upstream_seconds == 0.0
    assert r.generated_ids is None and r.prompt_ids is None and r.collected_ids
    assert r.reply_chunks is None and r.reply_message is None and r.reply() is None
    assert r.tokens([1, 2]) is None  # no generated ids: no sequence


# ---- one event at a time ---------------------------------------------------------------


def test_events_other_than_data_and_done_pass_as_they_are() -> None:
    relay = StreamRelay(keep_params=False, collect_ids=False, strip_ids=False)
    assert relay.process_event(b"event: ping", b"\r\n\r\n") == b"event: ping\r\n\r\n"
    assert relay.process_event(b"data: [DONE]", SEP) == b""
    # "data:" without a space: forwarded byte for byte when nothing changes
    plain = b'data:{"choices":[{"delta":{"content":"a"},"finish_reason":null}]}'
    assert relay.process_event(plain, SEP) == plain + SEP
    # and rewritten from the payload, not from a fixed offset, when something does
    nulls = b'data:{"choices":[],"kv_transfer_params":null}'
    assert relay.process_event(nulls, SEP) == b'data: {"choices":[]}' + SEP


def test_null_params_are_cut_wherever_they_stand_and_the_rest_kept_byte_for_byte() -> None:
    relay = StreamRelay(keep_params=False, collect_ids=False, strip_ids=False)
    first = 'data: {"kv_transfer_params":null,"choices":[{"delta":{"content":"é"}}]}'.encode()
    assert (
        relay.process_event(first, SEP)
        == 'data: {"choices":[{"delta":{"content":"é"}}]}'.encode() + SEP
    )
    last = 'data: {"choices":[{"delta":{"content":"é"}}],"kv_transfer_params":null}'.encode()
    assert (
        relay.process_event(last, SEP)
        == 'data: {"choices":[{"delta":{"content":"é"}}]}'.encode() + SEP
    )
    spaced = 'data: {"choices": [{"delta": {"content": "é"}}], "kv_transfer_params": null}'.encode()
    assert (
        relay.process_event(spaced, SEP)
        == 'data: {"choices": [{"delta": {"content": "é"}}]}'.encode() + SEP
    )
    # an odd spelling strip_null_params does not know: decoded, the key dropped
    odd = b'data: {"kv_transfer_params" :null,"choices":[]}'
    assert relay.process_event(odd, SEP) == b'data: {"choices":[]}' + SEP
    keep = StreamRelay(keep_params=True, collect_ids=False, strip_ids=False)
    assert keep.process_event(spaced, SEP) == spaced + SEP
    assert keep.process_event(first, SEP) == first + SEP


def test_ids_are_taken_from_the_first_prompt_and_every_chunk_and_stripped() -> None:
    relay = StreamRelay(keep_params=False, collect_ids=True, strip_ids=True)
    only_prompt = b'data: {"choices":[],"prompt_token_ids":[1,2]}'
    assert relay.process_event(only_prompt, SEP) == b'data: {"choices":[]}' + SEP
    # later prompt ids are cut too (but not taken); generated ids that are no int list stay
    again = b'data: {"choices":[{"token_ids":"x"}],"prompt_token_ids":[9]}'
    assert relay.process_event(again, SEP) == b'data: {"choices":[{"token_ids":"x"}]}' + SEP
    only_gen = b'data: {"choices":[{"text":"x","token_ids":[5]}]}'
    assert relay.process_event(only_gen, SEP) == b'data: {"choices":[{"text":"x"}]}' + SEP
    r = relay.result
    assert r.prompt_ids == [1, 2] and r.generated_ids == [5] and r.tokens() == [1, 2, 5]
    kept = StreamRelay(keep_params=False, collect_ids=True, strip_ids=False)
    assert kept.process_event(only_gen, SEP) == only_gen + SEP
    assert kept.result.prompt_ids is None and kept.result.tokens([3]) == [3, 5]


def test_the_first_untracked_delta_is_the_one_reported() -> None:
    relay = StreamRelay(keep_params=False, collect_ids=False, strip_ids=False)
    relay.process_event(data({"choices": [{"delta": {"content": "a"}}]}), SEP)
    assert relay.result.untracked is None
    relay.process_event(data({"choices": [{"delta": {"reasoning_content": "hm"}}]}), SEP)
    relay.process_event(data({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}), SEP)
    assert relay.result.untracked == "reasoning_content"
    every = {"reasoning": "hm", "tool_calls": [{"index": 0}], "function_call": {"name": "f"}}
    other = StreamRelay(keep_params=False, collect_ids=False, strip_ids=False)
    other.process_event(data({"choices": [{"delta": every}]}), SEP)
    assert other.result.untracked == "reasoning"


def test_terminal_chunk_records_whether_it_carried_the_params_key() -> None:
    relay = StreamRelay(keep_params=False, collect_ids=False, strip_ids=False)
    last = data({"choices": [{"delta": {}, "finish_reason": "length"}]})
    assert relay.process_event(last, SEP) == last + SEP
    assert relay.result.terminal_params_key is False and relay.result.finish_reason == "length"
    with_key = data(
        {"choices": [{"delta": {}, "finish_reason": "stop"}], "kv_transfer_params": None}
    )
    assert (
        relay.process_event(with_key, SEP)
        == data({"choices": [{"delta": {}, "finish_reason": "stop"}]}) + SEP
    )
    assert relay.result.terminal_params_key is True and relay.result.params is None


def test_a_terminal_looking_chunk_that_is_none_loses_only_its_params_key() -> None:
    # finish_reason outside the choices: no terminal chunk, the (null) params still cut
    odd = b'data: {"choices":[],"finish_reason":"stop","kv_transfer_params":null}'
    relay = StreamRelay(keep_params=False, collect_ids=False, strip_ids=False)
    assert relay.process_event(odd, SEP) == b'data: {"choices":[],"finish_reason":"stop"}' + SEP
    assert relay.result.finish_reason is None
    keep = StreamRelay(keep_params=True, collect_ids=False, strip_ids=False)
    assert keep.process_event(odd, SEP) == odd + SEP
    spaced = b'data: {"choices": [], "finish_reason": "stop"}'  # no params key: left as sent
    assert relay.process_event(spaced, SEP) == spaced + SEP
    # a params key deeper in the chunk is not D's: the chunk passes whole
    nested = b'data: {"choices":[],"x":{"kv_transfer_params":{"a":1}}}'
    assert relay.process_event(nested, SEP) == nested + SEP


def test_terminal_chunk_with_invalid_params_or_json() -> None:
    bad = dict(D_PARAMS, remote_port="x")
    last = data({"choices": [{"delta": {}, "finish_reason": "stop"}], "kv_transfer_params": bad})
    relay = StreamRelay(keep_params=False, collect_ids=False, strip_ids=False)
    assert (
        relay.process_event(last, SEP)
        == data({"choices": [{"delta": {}, "finish_reason": "stop"}]}) + SEP
    )
    assert relay.result.params is None
    keep = StreamRelay(keep_params=True, collect_ids=False, strip_ids=False)
    assert keep.process_event(last, SEP) == last + SEP
    broken = b'data: {"choices":[{"finish_reason":"stop"}],"kv_transfer_params":{'
    assert relay.process_event(broken, SEP) == broken + SEP  # not JSON: left as it is
    listed = b'data: [{"finish_reason":"stop","kv_transfer_params":{"a":1}}]'
    assert relay.process_event(listed, SEP) == listed + SEP  # not an object: left as it is


def test_reply_collected_from_the_streamed_chunks() -> None:
    relay = StreamRelay(keep_params=False, collect_ids=False, strip_ids=False, collect_reply=True)
    for text in ("Hel", "lo"):
        relay.process_event(data({"choices": [{"index": 0, "delta": {"content": text}}]}), SEP)
    relay.process_event(b"data: [DONE]", SEP)
    assert relay.result.reply() == {"role": "assistant", "content": "Hello", "tool_calls": None}


# ---- a non-streaming answer --------------------------------------------------------------


ANSWER = {
    "id": "cmpl-1",
    "object": "chat.completion",
    "prompt_token_ids": [1, 2],
    "choices": [
        {
            "index": 0,
            "finish_reason": "stop",
            "token_ids": [5, 6],
            "prompt_token_ids": [7],
            "message": {"role": "assistant", "content": "hi", "reasoning_content": "hm"},
        },
        "not a choice",
    ],
    "kv_transfer_params": D_PARAMS,
}


def test_digest_response_captures_and_strips() -> None:
    relay = StreamRelay(keep_params=False, collect_ids=True, strip_ids=True)
    body = relay.digest_response(json.loads(json.dumps(ANSWER)))
    assert body == {
        "id": "cmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "hi", "reasoning_content": "hm"},
            }
        ],
    }
    r = relay.result
    assert r.params is not None and r.params.remote_request_id == "cmpl-d-1"
    assert (r.finish_reason, r.prompt_ids, r.generated_ids) == ("stop", [1, 2], [5, 6])
    assert r.untracked == "reasoning_content" and r.done and r.reply() is None


def test_digest_response_keeps_what_it_is_told_to() -> None:
    relay = StreamRelay(keep_params=True, collect_ids=True, strip_ids=False, collect_reply=True)
    answer = json.loads(json.dumps(ANSWER))
    del answer["prompt_token_ids"]  # the choice's own prompt ids stand in
    assert relay.digest_response(answer) == answer
    r = relay.result
    assert r.prompt_ids == [7] and r.tokens() == [7, 5, 6]
    assert r.reply() == {"role": "assistant", "content": "hi", "reasoning_content": "hm"}


def test_digest_response_without_choices_or_ids() -> None:
    relay = StreamRelay(keep_params=False, collect_ids=True, strip_ids=False)
    assert relay.digest_response({"choices": [], "kv_transfer_params": None}) == {"choices": []}
    r = relay.result
    assert (r.finish_reason, r.params, r.untracked, r.done) == (None, None, None, True)
    gen_only = StreamRelay(keep_params=False, collect_ids=True, strip_ids=False)
    gen_only.digest_response({"choices": [{"token_ids": [5], "finish_reason": "length"}]})
    assert gen_only.result.generated_ids is None and gen_only.result.finish_reason == "length"
    stripped = StreamRelay(keep_params=False, collect_ids=True, strip_ids=True)
    assert stripped.digest_response({"choices": [{"text": "x"}]}) == {"choices": [{"text": "x"}]}
    with pytest.raises(TypeError, match=r"^decode answer is not a JSON object$"):
        relay.digest_response([1])


# ---- a stream made of a whole answer -----------------------------------------------------


def _events(raw: bytes) -> list[Any]:
    events = raw.split(SEP)
    assert events[-1] == b"" and all(e.startswith(b"data: ") for e in events[:-1])
    return [e[6:] if e == b"data: [DONE]" else json.loads(e[6:]) for e in events[:-1]]


def test_synthesize_sse_chat_every_field() -> None:
    body = {
        "id": "x",
        "created": 1,
        "model": "m",
        "object": "chat.completion",
        "choices": [
            {
                "index": 3,
                "finish_reason": "tool_calls",
                "stop_reason": None,
                "logprobs": None,
                "token_ids": [3],
                "message": {
                    "role": "assistant",
                    "tool_calls": [],
                    "content": "hi",
                    "reasoning_content": None,
                    "function_call": {"n": 1},
                },
            },
            {
                "finish_reason": "stop",
                "message": {
                    "content": "yo",
                    "tool_calls": [
                        {"id": "a", "type": "function"},
                        {"id": "b", "type": "function"},
                    ],
                },
            },
        ],
        "usage": {"total_tokens": 3},
    }
    raw = synthesize_sse(body, "chat/completions", include_usage=True)
    assert raw.startswith(b'data: {"id":"x","created":1,"model":"m","object":"chat.completion.')
    assert _events(raw) == [
        {
            "id": "x",
            "created": 1,
            "model": "m",
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "index": 3,
                    "delta": {"role": "assistant", "content": "hi", "function_call": {"n": 1}},
                    "logprobs": None,
                    "finish_reason": "tool_calls",
                    "stop_reason": None,
                    "token_ids": [3],
                },
                {
                    "index": 0,
                    "delta": {
                        "role": "assistant",
                        "content": "yo",
                        "tool_calls": [
                            {"id": "a", "type": "function", "index": 0},
                            {"id": "b", "type": "function", "index": 1},
                        ],
                    },
                    "finish_reason": "stop",
                },
            ],
        },
        {
            "id": "x",
            "created": 1,
            "model": "m",
            "object": "chat.completion.chunk",
            "choices": [],
            "usage": {"total_tokens": 3},
        },
        b"[DONE]",
    ]
    assert _events(synthesize_sse(body, "chat/completions", include_usage=False))[1] == b"[DONE]"


def test_synthesize_sse_completions_and_no_usage() -> None:
    body = {
        "id": "y",
        "choices": [
            {"index": 1, "text": "abc", "finish_reason": "length"},
            {"finish_reason": "stop"},
        ],
        "usage": None,
    }
    assert _events(synthesize_sse(body, "completions", include_usage=True)) == [
        {
            "id": "y",
            "object": "text_completion",
            "choices": [
                {"index": 1, "text": "abc", "finish_reason": "length"},
                {"index": 0, "text": "", "finish_reason": "stop"},
            ],
        },
        b"[DONE]",
    ]
