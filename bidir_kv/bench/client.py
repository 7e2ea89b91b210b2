"""Streaming chat client: TTFT at the first non-empty content delta, as vLLM's benchmark.

One aiohttp session per run; per chunk the client does one ``json.loads`` and
nothing else, so it stays far from being the bottleneck (``bench
--check-client`` measures the margin).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from bidir_kv.protocol import iter_sse_data

__all__ = ["ChatResult", "build_chat_body", "stream_chat"]


@dataclass
class ChatResult:
    """What one streamed request produced. Times are ``time.perf_counter`` seconds."""

    ok: bool
    status: int
    start: float
    ttft_s: float | None = None
    latency_s: float | None = None
    text: str = ""
    num_chunks: int = 0
    first_chunk_tokens: int = 0
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    saw_kv_transfer_params: bool = False
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.num_chunks


def build_chat_body(
    model: str,
    messages: Sequence[Mapping[str, str]],
    max_tokens: int,
    conversation_id: str | None,
    *,
    ignore_eos: bool = True,
) -> dict[str, Any]:
    """The request body vLLM's multi-turn benchmark sends (plus usage and ``ignore_eos``)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": list(messages),
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    return body


def _first_choice(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        return choices[0]
    return None


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    *,
    headers: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
) -> ChatResult:
    """POST ``body`` to ``{url}/v1/chat/completions`` and time the stream."""
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    start = time.perf_counter()
    res = ChatResult(ok=False, status=0, start=start)
    parts: list[str] = []
    try:
        async with session.post(
            endpoint,
            json=body,
            headers=dict(headers or {}),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            res.status = resp.status
            if resp.status != 200:
                detail = (await resp.text())[:300]
                res.error = f"HTTP {resp.status}: {detail}"
                res.latency_s = time.perf_counter() - start
                return res
            buf = b""
            async for raw in resp.content.iter_any():
                buf += raw
                *lines, buf = buf.split(b"\n")
                for data in iter_sse_data(lines):
                    if data == b"[DONE]":
                        continue
                    _consume(res, parts, data)
            for data in iter_sse_data([buf]):
                if data != b"[DONE]":
                    _consume(res, parts, data)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        res.latency_s = time.perf_counter() - start
        return res
    res.latency_s = time.perf_counter() - start
    res.text = "".join(parts)
    if res.ttft_s is None:
        res.error = "stream ended without any content"
    else:
        res.ok = True
    return res


def _consume(res: ChatResult, parts: list[str], data: bytes) -> None:
    now = time.perf_counter()
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"SSE chunk is not a JSON object: {data[:80]!r}")
    if obj.get("kv_transfer_params"):
        res.saw_kv_transfer_params = True
    usage = obj.get("usage")
    if isinstance(usage, Mapping):
        if isinstance(usage.get("completion_tokens"), int):
            res.completion_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            res.prompt_tokens = usage["prompt_tokens"]
    choice = _first_choice(obj)
    if choice is None:
        return
    if choice.get("finish_reason") is not None:
        res.finish_reason = str(choice["finish_reason"])
    delta = choice.get("delta")
    content = delta.get("content") if isinstance(delta, Mapping) else None
    if not content:
        return
    parts.append(content)
    res.num_chunks += 1
    if res.ttft_s is None:
        res.ttft_s = now - res.start
        ids = choice.get("token_ids")
        res.first_chunk_tokens = len(ids) if isinstance(ids, list) and ids else 1
