"""bidir_kv.client without a network: the SSE reader, the result model, typed failures.

httpx's ``MockTransport`` stands in for the node; one test uses a real refused port to
check the translation of an OS-level failure.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest

from bidir_kv.client import (
    CHAT_PATH,
    AsyncNodeClient,
    ClientError,
    HTTPStatusError,
    MalformedResponse,
    NodeClient,
    RequestTimeout,
    StreamCut,
    TokenClient,
    TransportError,
    read_reply,
)
from bidir_kv.client.sse import aiter_data, iter_data
from bidir_kv.errors import BidirKVError
from bidir_kv.protocol import KVTransferParams

URL = "http://node.test:8000"
D_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_block_ids": [[1, 2]],
    "remote_engine_id": "d0",
    "remote_request_id": "r1",
    "remote_host": "127.0.0.1",
    "remote_port": 5601,
}


def sse(*chunks: Any, done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return body + (b"data: [DONE]\n\n" if done else b"")


COMPLETION_STREAM = sse(
    {
        "choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": None}],
        "kv_transfer_params": None,
    },
    {"choices": [{"index": 0, "text": "ab", "token_ids": [7, 8], "finish_reason": None}]},
    {
        "choices": [{"index": 0, "text": "c", "token_ids": [9], "finish_reason": "length"}],
        "kv_transfer_params": D_PARAMS,
    },
    {
        "choices": [],
        "usage": {
            "prompt_tokens": 4,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 2},
        },
    },
)


def pieces(raw: bytes, size: int) -> list[bytes]:
    return [raw[i : i + size] for i in range(0, len(raw), size)]


def mock(handler: Callable[[httpx.Request], httpx.Response]) -> NodeClient:
    return NodeClient(URL, transport=httpx.MockTransport(handler))


def answer(body: bytes, status: int = 200, stream: bool = True) -> Callable[..., httpx.Response]:
    ctype = "text/event-stream" if stream else "application/json"
    return lambda request: httpx.Response(status, content=body, headers={"Content-Type": ctype})


# ---- the SSE reader -----------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 3, 17, 4096])
async def test_sse_payloads_survive_any_cut(size: int) -> None:
    raw = b'data: {"a": 1}\r\n\r\n: comment\ndata:{"b":2}\n\nevent: x\ndata: [DONE]'
    want = [b'{"a": 1}', b'{"b":2}', b"[DONE]"]
    assert list(iter_data(pieces(raw, size))) == want

    async def collect() -> list[bytes]:
        async def gen() -> AsyncIterator[bytes]:
            for p in pieces(raw, size):
                yield p

        return [d async for d in aiter_data(gen())]

    assert await collect() == want


# ---- the result model ---------------------------------------------------------------


def test_completion_stream_fills_the_one_result_model() -> None:
    res = mock(answer(COMPLETION_STREAM)).complete({"stream": True, "prompt": [1]})
    assert res.ok and res.status == 200 and res.stream
    assert res.token_ids == [7, 8, 9] and res.text == "abc" and res.finish_reason == "length"
    assert res.chunks == 4 and res.content_chunks == 2 and res.first_chunk_tokens == 2
    assert res.params == KVTransferParams.parse(D_PARAMS) and res.params_present
    assert res.params_chunk == 2 and res.params_on_terminal is True
    assert res.nonterminal_params_values == [None]  # the null on the opening chunk
    assert res.prompt_tokens == 4 and res.completion_tokens == 3 and res.cached_tokens == 2
    assert res.ttft is not None and 0 <= res.ttft <= res.elapsed
    assert res.raise_for_status() is res


def test_chat_stream_takes_ttft_at_the_first_content_delta() -> None:
    raw = sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "hi"}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    )
    res = mock(answer(raw)).complete({"stream": True}, path=CHAT_PATH)
    assert res.url == URL + CHAT_PATH
    assert res.text == "hi" and res.content_chunks == 1 and res.first_chunk_tokens == 1
    assert res.finish_reason == "stop" and res.params is None and not res.params_present
    assert res.output_tokens == 1  # no usage: one per content chunk


def test_non_streamed_answers_read_text_params_and_usage() -> None:
    body = {
        "choices": [{"text": "xyz", "token_ids": [3, 4], "finish_reason": "length"}],
        "kv_transfer_params": D_PARAMS,
        "usage": {"completion_tokens": 2},
    }
    res = mock(answer(json.dumps(body).encode(), stream=False)).complete({"stream": False})
    assert res.token_ids == [3, 4] and res.text == "xyz" and res.params is not None
    assert res.body == body and res.completion_tokens == 2 and res.ttft is None
    chat = {
        "choices": [{"message": {"role": "assistant", "content": "yo"}, "finish_reason": "stop"}],
        "kv_transfer_params": None,
    }
    res = mock(answer(json.dumps(chat).encode(), stream=False)).complete({}, path=CHAT_PATH)
    assert res.text == "yo" and res.params is None and res.params_present


def test_a_whole_body_reads_like_a_live_stream() -> None:
    live = mock(answer(COMPLETION_STREAM)).complete({"stream": True})
    reply = mock(answer(COMPLETION_STREAM)).post("/v1/completions", {"stream": True})
    whole = read_reply(reply, stream=True)
    for name in (
        "token_ids",
        "text",
        "finish_reason",
        "params",
        "params_chunk",
        "params_on_terminal",
        "nonterminal_params_values",
        "usage",
        "chunks",
    ):
        assert getattr(whole, name) == getattr(live, name), name


# ---- typed failures -----------------------------------------------------------------


def test_a_non_2xx_answer_is_a_result_until_raise_for_status() -> None:
    res = mock(answer(b'{"error": {"message": "bad max_tokens"}}', 400, stream=False)).complete(
        {"stream": True}
    )
    assert not res.ok and res.status == 400 and "bad max_tokens" in (res.error or "")
    with pytest.raises(HTTPStatusError) as info:
        res.raise_for_status()
    assert info.value.status == 400 and "bad max_tokens" in info.value.body
    assert isinstance(info.value, ClientError) and isinstance(info.value, BidirKVError)
    with pytest.raises(HTTPStatusError):
        mock(answer(b"nope", 503)).get_json("/health")


@pytest.mark.parametrize(
    "raw, what",
    [
        (b"data: {not json\n\n", "not JSON"),
        (b"data: [1, 2]\n\n", "not a JSON object"),
        (b": only a comment\n\n", "without data"),
        (
            sse({"choices": [{"finish_reason": "stop"}], "kv_transfer_params": {"tp_size": 0}}),
            "tp_size",
        ),
    ],
)
def test_unreadable_streams_are_malformed(raw: bytes, what: str) -> None:
    with pytest.raises(MalformedResponse, match=what):
        mock(answer(raw)).complete({"stream": True})


def test_unreadable_bodies_are_malformed() -> None:
    for raw in (b"<html>", b"[1]"):
        with pytest.raises(MalformedResponse):
            mock(answer(raw, stream=False)).complete({"stream": False})
    with pytest.raises(MalformedResponse):
        mock(answer(b"[1]", stream=False)).get("/x").json_object()


@pytest.mark.parametrize(
    "exc, kind",
    [
        (httpx.ConnectError("refused"), TransportError),
        (httpx.ReadError("reset by peer"), TransportError),
        (httpx.RemoteProtocolError("cut mid-stream"), TransportError),
        (httpx.ReadTimeout("slow"), RequestTimeout),
        (httpx.ConnectTimeout("slow"), RequestTimeout),
    ],
)
def test_httpx_failures_become_ours(exc: Exception, kind: type[ClientError]) -> None:
    def fail(request: httpx.Request) -> httpx.Response:
        raise exc

    with pytest.raises(kind) as info:
        mock(fail).complete({"stream": True})
    assert info.value.url == URL + "/v1/completions" and info.value.__cause__ is exc
    with pytest.raises(kind):
        mock(fail).metrics()


class _CutAfter(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A stream body that breaks after ``n`` of its SSE events (a node that died)."""

    def __init__(self, raw: bytes, n: int) -> None:
        self.events = raw.split(b"\n\n")[:n]

    def __iter__(self) -> Iterator[bytes]:
        for e in self.events:
            yield e + b"\n\n"
        raise httpx.RemoteProtocolError("peer closed connection without sending complete body")

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for e in self.events:
            yield e + b"\n\n"
        raise httpx.RemoteProtocolError("peer closed connection without sending complete body")


async def test_a_stream_cut_after_its_headers_keeps_what_it_delivered() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_CutAfter(COMPLETION_STREAM, 2))

    with pytest.raises(StreamCut) as cut:
        mock(handler).complete({"stream": True})
    assert isinstance(cut.value, TransportError) and cut.value.url == URL + "/v1/completions"
    part = cut.value.partial
    assert part.chunks == 2 and part.token_ids == [7, 8] and part.finish_reason is None
    async with AsyncNodeClient(URL, transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(StreamCut) as acut:
            await client.complete({"stream": True})
    assert acut.value.partial.chunks == 2
    # no headers yet: a plain transport error, nothing delivered
    with pytest.raises(TransportError) as early:
        mock(lambda r: (_ for _ in ()).throw(httpx.ReadError("reset"))).complete({"stream": True})
    assert not isinstance(early.value, StreamCut)


def test_a_refused_connection_is_a_transport_error() -> None:
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        with pytest.raises(TransportError, match="ConnectError"):
            TokenClient(f"http://127.0.0.1:{port}", timeout=2).complete([5, 6], 1)


def test_redirects_are_not_followed_and_timeouts_are_per_request() -> None:
    seen: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions["timeout"]["read"])
        return httpx.Response(307, headers={"Location": "http://elsewhere.test/"})

    client = NodeClient(URL, timeout=9.0, transport=httpx.MockTransport(handler))
    assert client.get("/health").status == 307
    assert client.get("/health", timeout=0.5).status == 307
    assert seen == [9.0, 0.5]


def test_metrics_parses_only_the_names_asked_for() -> None:
    text = "# TYPE vllm:a counter\nvllm:a_total 3\n# TYPE vllm:b counter\nvllm:b_total 5\n"
    client = mock(lambda r: httpx.Response(200, text=text))
    assert client.metrics().value("vllm:b_total") == 5
    snap = client.metrics(["vllm:a_total"])
    assert snap.value("vllm:a_total") == 3 and snap.value("vllm:b_total") == 0


# ---- the async client ---------------------------------------------------------------


async def test_async_client_reads_a_stream_in_small_pieces_and_stops_early() -> None:
    class Trickle(httpx.AsyncByteStream):
        def __init__(self, raw: bytes) -> None:
            self.raw = raw
            self.closed = False

        async def __aiter__(self) -> AsyncIterator[bytes]:
            for p in pieces(self.raw, 7):
                yield p

        async def aclose(self) -> None:
            self.closed = True

    streams: list[Trickle] = []

    def handler(request: httpx.Request) -> httpx.Response:
        streams.append(Trickle(COMPLETION_STREAM))
        return httpx.Response(200, stream=streams[-1])

    async def go() -> tuple[Any, list[bytes]]:
        async with AsyncNodeClient(URL, transport=httpx.MockTransport(handler)) as client:
            res = await client.complete({"stream": True})
            got = []
            async with client.open_stream("/v1/completions", {"stream": True}) as data:
                async for payload in data:
                    got.append(payload)
                    break
            return res, got

    res, got = await go()
    assert res.token_ids == [7, 8, 9] and res.params_chunk == 2
    assert len(got) == 1 and got[0].startswith(b"{")
    assert all(s.closed for s in streams)  # the early leaver closed its connection too


async def test_async_failures_are_translated_at_the_same_point() -> None:
    def fail(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    async def go() -> None:
        async with AsyncNodeClient(URL, transport=httpx.MockTransport(fail)) as client:
            await client.complete({"stream": True})

    with pytest.raises(TransportError):
        await go()
