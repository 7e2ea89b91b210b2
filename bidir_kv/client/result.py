"""The one result model of a completion or chat call, streamed or not, and how it is read.

:class:`Completion` is what every caller gets back from ``/v1/completions`` and
``/v1/chat/completions``: token ids, text, ``finish_reason``, ``kv_transfer_params``
and where they appeared, usage, timings and chunk counts. A non-2xx answer is a
result too (``status`` and ``error``, the body excerpt); ``raise_for_status()`` turns
it into :class:`~bidir_kv.client.errors.HTTPStatusError`.

Reading a stream costs one ``json.loads`` per chunk; ``kv_transfer_params`` is parsed
only by :func:`bidir_kv.protocol.scan_terminal_chunk`, and only for a chunk that
carries the key or a ``finish_reason``. TTFT is taken at the first chunk with
non-empty content (``text`` of a completion, ``delta.content`` of a chat chunk), as
vLLM's multi-turn benchmark measures it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bidir_kv.client.errors import (
    BODY_EXCERPT,
    HTTPStatusError,
    MalformedResponse,
    TransportError,
)
from bidir_kv.protocol import (
    KVTransferParams,
    ProtocolError,
    params_from_response,
    scan_terminal_chunk,
)

__all__ = ["Completion", "StreamCut", "StreamReader", "read_body", "read_error"]


@dataclass
class Completion:
    """One completion or chat call. Times are ``time.perf_counter`` seconds."""

    status: int
    url: str = ""
    stream: bool = False
    start: float = 0.0  # when the request was sent
    elapsed: float = 0.0  # until the last byte (the whole answer)
    ttft: float | None = None  # until the first chunk with content (streams only)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    params: KVTransferParams | None = None
    params_present: bool = False  # the answer carried the key at all (null included)
    usage: dict[str, Any] | None = None
    error: str | None = None  # the body excerpt of a non-2xx answer
    body: dict[str, Any] | None = None  # the decoded object of a non-streamed answer
    chunks: int = 0  # SSE data chunks, ``[DONE]`` excluded
    content_chunks: int = 0  # chunks that carried content
    first_chunk_tokens: int = 0  # tokens in the first content chunk (1 without token ids)
    # streams: when each content chunk arrived (perf_counter s): the inter-token latencies
    content_times: list[float] = field(default_factory=list)
    # streams: when each chunk carrying token ids arrived (a token may decode to no text)
    token_times: list[float] = field(default_factory=list)
    # streams: where params appeared (chunk index; whether that chunk had a finish_reason)
    params_chunk: int | None = None
    params_on_terminal: bool | None = None
    nonterminal_params_values: list[Any] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and self.error is None

    def raise_for_status(self) -> Completion:
        """This result when it is a 2xx answer, else :class:`HTTPStatusError`."""
        if not self.ok:
            raise HTTPStatusError(self.status, self.error or "", url=self.url)
        return self

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
        return None if value is None else int(value)

    @property
    def prompt_tokens(self) -> int | None:
        return _usage_int(self.usage, "prompt_tokens")

    @property
    def completion_tokens(self) -> int | None:
        return _usage_int(self.usage, "completion_tokens")

    @property
    def itl(self) -> list[float]:
        """Gaps between successive content chunks, seconds (vLLM's benchmark ``itl``:
        one per chunk after the first; a chunk may carry several tokens)."""
        t = self.content_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        """A stream's time per output token, seconds: (latency − first token) / (tokens −
        1), vLLM's benchmark definition, the first token being the first chunk with token
        ids (else with content); None for one token or a non-streamed answer."""
        times = self.token_times or self.content_times
        n = len(self.token_ids) or self.content_chunks
        if not self.stream or not times or n < 2:
            return None
        return (self.start + self.elapsed - times[0]) / (n - 1)

    @property
    def output_tokens(self) -> int:
        """Generated tokens: usage's count, else one per content chunk."""
        n = self.completion_tokens
        return n if n is not None else self.content_chunks


class StreamCut(TransportError):
    """A streamed answer that began (a 2xx status and headers) and was cut before its
    end: a :class:`TransportError` that keeps what the stream delivered (``partial``:
    its chunks, tokens, text so far; never a ``[DONE]``)."""

    def __init__(self, message: str, *, url: str | None = None, partial: Completion) -> None:
        super().__init__(message, url=url)
        self.partial = partial


def _usage_int(usage: Mapping[str, Any] | None, key: str) -> int | None:
    value = (usage or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_error(out: Completion, raw: bytes) -> Completion:
    """A non-2xx answer: its body text becomes ``error``."""
    out.error = raw.decode(errors="replace")[:BODY_EXCERPT]
    return out


def _params(obj: Mapping[str, Any], url: str) -> KVTransferParams | None:
    try:
        return params_from_response(obj)
    except ProtocolError as exc:
        raise MalformedResponse(str(exc), url=url) from exc


def read_body(out: Completion, raw: bytes) -> Completion:
    """A non-streamed 2xx answer (completion or chat object)."""
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise MalformedResponse(f"answer is not JSON: {raw[:80]!r}", url=out.url) from exc
    if not isinstance(obj, dict):
        raise MalformedResponse(f"answer is not a JSON object: {raw[:80]!r}", url=out.url)
    out.body = obj
    choices = obj.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    if not isinstance(choice, dict):
        raise MalformedResponse(f"choice is not a JSON object: {choice!r:.80}", url=out.url)
    out.token_ids = [int(t) for t in (choice.get("token_ids") or [])]
    message = choice.get("message")
    text = choice.get("text")
    if text is None and isinstance(message, dict):
        text = message.get("content")
    out.text = str(text or "")
    out.finish_reason = choice.get("finish_reason")
    out.params = _params(obj, out.url)
    out.params_present = "kv_transfer_params" in obj
    usage = obj.get("usage")
    out.usage = usage if isinstance(usage, dict) else None
    return out


class StreamReader:
    """Folds a stream's ``data:`` payloads into a :class:`Completion`, one at a time."""

    __slots__ = ("_parts", "out")

    def __init__(self, out: Completion) -> None:
        self.out = out
        self._parts: list[str] = []

    def feed(self, data: bytes, now: float) -> None:
        """One payload received at ``now``; ``[DONE]`` is skipped."""
        if data == b"[DONE]":
            return
        out = self.out
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise MalformedResponse(f"SSE chunk is not JSON: {data[:80]!r}", url=out.url) from exc
        if not isinstance(obj, dict):
            raise MalformedResponse(f"SSE chunk is not a JSON object: {data[:80]!r}", url=out.url)
        index = out.chunks
        out.chunks += 1
        has_params = "kv_transfer_params" in obj
        maybe_terminal = has_params
        first_ids: Any = None
        content = False
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            ids = choice.get("token_ids")
            if ids:
                out.token_ids.extend(int(t) for t in ids)
                if not out.token_times or out.token_times[-1] != now:
                    out.token_times.append(now)
            piece = choice.get("text")
            if piece is None:
                delta = choice.get("delta")
                piece = delta.get("content") if isinstance(delta, dict) else None
            if piece:
                self._parts.append(str(piece))
                if not content:
                    content, first_ids = True, ids
            if choice.get("finish_reason") is not None:
                out.finish_reason = str(choice["finish_reason"])
                maybe_terminal = True
        if content:
            out.content_chunks += 1
            out.content_times.append(now)
            if out.ttft is None:
                out.ttft = now - out.start
                out.first_chunk_tokens = (
                    len(first_ids) if isinstance(first_ids, list) and first_ids else 1
                )
        usage = obj.get("usage")
        if usage and isinstance(usage, dict):
            out.usage = usage
        if maybe_terminal:
            self._terminal(obj, data, index, has_params)

    def _terminal(self, obj: dict[str, Any], data: bytes, index: int, has_params: bool) -> None:
        out = self.out
        if has_params:
            out.params_present = True
        try:
            terminal = scan_terminal_chunk(data)
        except ProtocolError as exc:
            raise MalformedResponse(str(exc), url=out.url) from exc
        if terminal is not None and terminal.params is not None:
            out.params = terminal.params
            out.params_chunk = index
            out.params_on_terminal = bool(terminal.finish_reason)
        elif has_params and terminal is None:
            out.nonterminal_params_values.append(obj["kv_transfer_params"])

    def finish(self, now: float) -> Completion:
        """The stream ended at ``now``; one without any data chunk is malformed."""
        out = self.out
        out.elapsed = now - out.start
        out.text = "".join(self._parts)
        if out.chunks == 0:
            raise MalformedResponse("stream ended without data", url=out.url)
        return out
