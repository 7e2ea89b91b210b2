"""Streaming client and runner against an in-process stub chat server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest
from aiohttp import web

from bidir_kv.bench.client import build_chat_body, stream_chat
from bidir_kv.bench.distributions import Distribution
from bidir_kv.bench.runner import RunOptions, run_point
from bidir_kv.bench.workload import WorkloadSpec, build_conversations
from bidir_kv.client import AsyncNodeClient, HTTPStatusError


class Stub:
    """Answers with an empty role chunk, then ``n`` one-token chunks, a terminal chunk, usage."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, Any], dict[str, str]]] = []
        self.active = 0
        self.max_active = 0
        self.gate: asyncio.Event | None = None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((body, dict(request.headers)))
        if body.get("max_tokens") == 999:
            return web.json_response({"error": "nope"}, status=400)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def send(obj: dict[str, Any]) -> None:
                await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

            await send(
                {
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None,
                        }
                    ],
                    "kv_transfer_params": None,
                }
            )
            await asyncio.sleep(0.01)
            n = body["max_tokens"]
            for i in range(n):
                last = i == n - 1
                await send(
                    {
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"content": f" w{i}"},
                                "finish_reason": "length" if last else None,
                            }
                        ],
                        "kv_transfer_params": {"do_remote_decode": True} if last else None,
                    }
                )
            await send({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}})
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.active -= 1


async def with_server(coro_fn):
    stub = Stub()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", stub.chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        return stub, await coro_fn(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


async def test_ttft_is_at_the_first_content_token() -> None:
    async def go(url: str):
        async with AsyncNodeClient(url) as s:
            body = build_chat_body("tiny", [{"role": "user", "content": "hi"}], 5, "c-1")
            ok = await stream_chat(s, body, headers={"X-Session-ID": "c-1"})
            with pytest.raises(HTTPStatusError) as bad:
                await stream_chat(s, {**body, "max_tokens": 999})
            return ok, bad.value

    stub, (ok, bad) = await with_server(go)
    assert ok.ok and ok.error is None
    assert ok.text == " w0 w1 w2 w3 w4"
    assert ok.content_chunks == 5 and ok.completion_tokens == 5 and ok.prompt_tokens == 7
    assert ok.chunks == 7  # the role chunk and the usage chunk carry no content
    assert ok.first_chunk_tokens == 1 and ok.finish_reason == "length"
    assert ok.params is not None and ok.params_on_terminal and ok.params_chunk == 5
    # the empty role chunk came 10 ms before the first token: TTFT is not taken there
    assert ok.ttft is not None
    assert 0.01 <= ok.ttft <= ok.elapsed
    assert bad.status == 400 and "HTTP 400" in str(bad) and "nope" in bad.body
    body, headers = stub.requests[0]
    assert body["conversation_id"] == "c-1" and headers["X-Session-ID"] == "c-1"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


async def test_runner_sends_exact_continuations_with_concurrency_limits() -> None:
    spec = WorkloadSpec(
        prefix_tokens=30,
        num_conversations=5,
        num_turns=3,
        input_tokens=5,
        output_tokens=4,
        think_time=Distribution.parse("const:0.02"),
    )
    convs = build_conversations(spec)

    async def go(url: str):
        opts = RunOptions(url=url, num_clients=2, max_active_conversations=3)
        return await run_point(convs, opts, leg="on")

    stub, result = await with_server(go)
    recs = result.records
    assert len(recs) == 15 and result.errors == 0 and not result.interrupted
    assert stub.max_active <= 2  # two clients
    by_conv: dict[str, list] = {}
    for body, headers in stub.requests:
        assert headers["X-Session-ID"] == body["conversation_id"]
        by_conv.setdefault(body["conversation_id"], []).append(body["messages"])
    for conv in convs:
        msgs = by_conv[conv.conversation_id]
        assert [len(m) for m in msgs] == [1, 3, 5]
        # every prompt is the previous prompt + the real answer + the next user turn
        assert msgs[1][:1] == msgs[0] and msgs[2][:3] == msgs[1]
        assert msgs[1][1] == {"role": "assistant", "content": " w0 w1 w2 w3"}
        assert [m["content"] for m in msgs[2][::2]] == [t.content for t in conv.turns]
    # records: vLLM fields filled from what was sent and received
    for r in recs:
        assert r.output_num_tokens == 4 and r.ok
        assert r.input_num_turns == 2 * r.turn - 1
    turn3 = [r for r in recs if r.turn == 3]
    conv0 = convs[0].turns
    want = conv0[0].content_tokens + conv0[1].content_tokens + conv0[2].content_tokens + 2 * 4
    assert any(r.input_num_tokens == want for r in turn3)
    # a conversation's next turn never starts before its previous answer + the think time
    for cid in by_conv:
        mine = sorted((r for r in recs if r.conversation_id == cid), key=lambda r: r.turn)
        for a, b in itertools.pairwise(mine):
            assert b.start_time_ms >= a.start_time_ms + a.latency_ms + 20 - 1


async def test_runner_stops_early_and_keeps_what_finished() -> None:
    spec = WorkloadSpec(
        prefix_tokens=10, num_conversations=4, num_turns=50, input_tokens=3, output_tokens=2
    )
    convs = build_conversations(spec)

    async def go(url: str):
        stop = asyncio.Event()
        done: list = []

        def on_request(rec) -> None:
            done.append(rec)
            if len(done) == 6:
                stop.set()

        res = await run_point(
            convs, RunOptions(url=url, num_clients=2), leg="off", on_request=on_request, stop=stop
        )
        return res

    _, res = await with_server(go)
    assert res.interrupted
    assert 6 <= len(res.records) < 200


@pytest.mark.parametrize("n", [1, 3])
def test_body_shape(n: int) -> None:
    body = build_chat_body("m", [{"role": "user", "content": "x"}] * n, 7, None, ignore_eos=False)
    assert "conversation_id" not in body and "ignore_eos" not in body
    assert body["max_tokens"] == 7 and len(body["messages"]) == n
