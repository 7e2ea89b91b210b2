"""OpenAI-style request parsing and response shapes, as vLLM's OpenAI server emits them.

Kept apart from the routes so the shapes (ids, ``usage``, ``kv_transfer_params``
placement per version) are in one place.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bidir_kv.engine.model import ChatTemplateError, Tokenizer, render_chat
from bidir_kv.protocol import KVTransferParams, ProtocolError, params_from_request

__all__ = ["ApiError", "ParsedRequest", "error_body", "now_s", "parse_request", "usage"]


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


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


# accepted only at their neutral values; anything else would be silently ignored
_UNSUPPORTED = ("echo", "stop", "logprobs", "top_logprobs", "prompt_logprobs", "best_of",
                "tools", "response_format", "guided_json", "guided_regex", "guided_choice",
                "suffix")  # fmt: skip


def _neutral(key: str, value: Any) -> bool:
    if value is None or value is False:
        return True
    if key == "best_of":
        return bool(value == 1)
    if key == "top_logprobs":
        return bool(value == 0)
    if key in ("stop", "tools"):
        return value in ([], "")
    if key == "response_format":
        return isinstance(value, Mapping) and value.get("type") == "text"
    return False


def _bool(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"'{key}' must be a boolean, got {v!r}")
    return v


def _opt_int(body: Mapping[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ApiError(400, f"'{key}' must be a non-negative integer, got {v!r}")
    return v


def parse_request(
    body: Any, *, chat: bool, tokenizer: Tokenizer, served_names: list[str]
) -> ParsedRequest:
    if not isinstance(body, Mapping):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model")
    if model is None:
        model = served_names[0]
    elif model not in served_names:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
    n = body.get("n", 1)
    if n not in (1, None):
        raise ApiError(400, "only n=1 is supported by the emulated engine")
    for key in _UNSUPPORTED:
        if not _neutral(key, body.get(key)):
            raise ApiError(400, f"'{key}' is not supported by the emulated engine")
    try:
        params = params_from_request(body)
    except ProtocolError as exc:
        raise ApiError(400, f"invalid kv_transfer_params: {exc}") from None
    if chat:
        try:
            text = render_chat(
                body.get("messages"),
                add_generation_prompt=_bool(body, "add_generation_prompt", True),
            )
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc)) from None
        prompt = tokenizer.encode(text, add_special_tokens=_bool(body, "add_special_tokens"))
        max_tokens = _opt_int(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens")
    else:
        prompt = _completion_prompt(body.get("prompt"), tokenizer, body)
        max_tokens = _opt_int(body, "max_tokens")
        if "max_tokens" not in body:
            max_tokens = 16  # OpenAI's and vLLM's default for completions
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
    ):
        raise ApiError(400, f"'stop_token_ids' must be a list of integers, got {stop_ids!r}")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, Mapping):
        raise ApiError(400, "'stream_options' must be an object")
    return ParsedRequest(
        chat=chat,
        model=str(model),
        prompt=prompt,
        max_tokens=max_tokens,
        stream=_bool(body, "stream"),
        include_usage=bool(opts.get("include_usage", False)),
        ignore_eos=_bool(body, "ignore_eos"),
        return_token_ids=_bool(body, "return_token_ids"),
        stop_token_ids=frozenset(stop_ids),
        params=params,
    )


def _completion_prompt(prompt: Any, tokenizer: Tokenizer, body: Mapping[str, Any]) -> list[int]:
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
