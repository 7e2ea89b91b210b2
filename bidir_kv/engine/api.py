"""OpenAI-style request parsing and response shapes, as vLLM's OpenAI server emits them.

Kept apart from the routes so the shapes (ids, ``usage``, ``kv_transfer_params``
placement per version) are in one place.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bidir_kv.engine.fields import refused_field
from bidir_kv.engine.model import ChatTemplateError, render_chat
from bidir_kv.engine.sampling import emulated_logprobs
from bidir_kv.errors import IntakeError
from bidir_kv.intake import InputError, check_request
from bidir_kv.intake.fields import effective_max_tokens
from bidir_kv.policy import ROOT_HASH
from bidir_kv.protocol import KVTransferParams, ProtocolError, params_from_request

__all__ = [
    "ApiError",
    "ParsedRequest",
    "chat_logprobs",
    "completion_logprobs",
    "error_body",
    "logprob_entries",
    "now_s",
    "parse_request",
    "render_prompt",
    "salt_root",
    "usage",
]


class ApiError(IntakeError):
    """A request the OpenAI routes refuse; the status and type vLLM answers it with."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.http_status = status
        self.error_type = kind
        self.message = message


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


@dataclass
class ParsedRequest:
    chat: bool
    model: str
    prompt: list[int]
    max_tokens: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool
    return_token_ids: bool
    stop_token_ids: frozenset[int]
    params: KVTransferParams | None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # number of top alternatives; None: no logprobs
    cache_salt: str | None = None


# The values below were checked by bidir_kv.intake.check_request (vLLM's field rules,
# shared with the router); these only read them.


def _bool(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key)
    return default if v is None else bool(v)


def _stop_strings(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    return tuple(s for s in stop if s)


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """Top alternatives per token, or None. Chat: ``logprobs`` (bool) and
    ``top_logprobs``; completions: ``logprobs`` (an int)."""
    if chat:
        return (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    top = body.get("logprobs")
    return None if top is None else int(top)


def salt_root(salt: str | None) -> bytes:
    """Parent of a request's first block hash: different salts never share a block."""
    if salt is None:
        return ROOT_HASH
    return hashlib.blake2b(b"cache_salt\0" + salt.encode(), digest_size=16).digest()


def _check_fields(body: Mapping[str, Any]) -> None:
    n = body.get("n", 1)
    if n not in (1, None) or isinstance(n, bool):
        raise ApiError(400, f"'n' must be 1 in the emulated engine, got {n!r}")
    refusal = refused_field(body)
    if refusal is not None:
        raise ApiError(400, refusal)


def _chat_prompt(body: Mapping[str, Any], tokenizer: Any) -> list[int]:
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise ApiError(400, "'chat_template_kwargs' must be an object")
    try:
        text = render_prompt(
            tokenizer, body.get("messages"), _bool(body, "add_generation_prompt", True), kwargs
        )
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc)) from None
    return list(tokenizer.encode(text, add_special_tokens=_bool(body, "add_special_tokens")))


def render_prompt(
    tokenizer: Any, messages: Any, add_generation_prompt: bool, kwargs: Mapping[str, Any]
) -> str:
    """The chat prompt text: the served tokenizer's template, else the builtin one."""
    if hasattr(tokenizer, "render_chat"):
        return str(tokenizer.render_chat(messages, add_generation_prompt, **kwargs))
    return render_chat(messages, add_generation_prompt=add_generation_prompt)


def parse_request(
    body: Any, *, chat: bool, tokenizer: Any, served_names: list[str]
) -> ParsedRequest:
    if not isinstance(body, Mapping):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model")
    if model is None:
        model = served_names[0]
    elif model not in served_names:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
    try:
        check_request(body, chat)
    except InputError as exc:
        raise ApiError(400, exc.message) from None
    _check_fields(body)
    try:
        params = params_from_request(body)
    except ProtocolError as exc:
        raise ApiError(400, f"invalid kv_transfer_params: {exc}") from None
    stream = _bool(body, "stream")
    if chat:
        prompt = _chat_prompt(body, tokenizer)
    else:
        prompt = _completion_prompt(body.get("prompt"), tokenizer, body)
    max_tokens = effective_max_tokens(body, chat)
    min_tokens = body.get("min_tokens") or 0
    stop_ids = body.get("stop_token_ids") or []
    opts = body.get("stream_options") or {}
    return ParsedRequest(
        chat=chat,
        model=str(model),
        prompt=prompt,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        ignore_eos=_bool(body, "ignore_eos"),
        return_token_ids=_bool(body, "return_token_ids"),
        stop_token_ids=frozenset(stop_ids),
        params=params,
        min_tokens=min_tokens,
        stop=_stop_strings(body),
        include_stop_str=_bool(body, "include_stop_str_in_output"),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        logprobs=_logprobs(body, chat),
        cache_salt=body.get("cache_salt"),
    )


def _completion_prompt(prompt: Any, tokenizer: Any, body: Mapping[str, Any]) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=_bool(body, "add_special_tokens", True))
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], list | str):
        try:
            return tokenizer.check_ids(prompt)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "batched prompts are not supported; send one prompt per request")
    raise ApiError(400, "'prompt' must be a string or a list of token ids")


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def now_s() -> int:
    return int(time.time())


def logprob_entries(
    tokenizer: Any, ids: list[int], start: int, top: int
) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """``(token text, logprob, [(alternative text, logprob), ...])`` per id (emulated)."""
    out = []
    for i, t in enumerate(ids):
        lp, alts = emulated_logprobs(t, start + i, max(0, top - 1))
        text = tokenizer.decode([t], skip_special_tokens=False)
        ranked = [(text, lp)] if top else []
        ranked += [
            (tokenizer.decode([a], skip_special_tokens=False), lp - 0.5 * (k + 1))
            for k, a in enumerate(alts)
        ]
        out.append((text, lp, ranked))
    return out


def chat_logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]]) -> dict[str, Any]:
    """vLLM's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def one(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**one(text, lp), "top_logprobs": [one(a, alp) for a, alp in ranked]}
            for text, lp, ranked in entries
        ]
    }


def completion_logprobs(
    entries: list[tuple[str, float, list[tuple[str, float]]]], offset: int
) -> dict[str, Any]:
    """vLLM's completions ``logprobs``: parallel lists, ``top_logprobs`` as dicts."""
    offsets = []
    for text, _, _ in entries:
        offsets.append(offset)
        offset += len(text)
    return {
        "text_offset": offsets,
        "token_logprobs": [lp for _, lp, _ in entries],
        "tokens": [text for text, _, _ in entries],
        "top_logprobs": [dict(ranked) for _, _, ranked in entries],
    }
