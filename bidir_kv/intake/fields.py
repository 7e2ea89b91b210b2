"""vLLM's rules for the values of request fields, checked once for router and engine.

Why one table: the router must refuse what an engine (D) would refuse *before* the
P leg, which is sent ``stream: false``, ``max_tokens: 1`` and none of the output
options, so P would otherwise prefill and lease a prompt D then refuses. The engine
applies the same rules, so both answer with the same words. Types are checked
strictly (a JSON ``"false"`` is not a boolean); docs/engine.md and docs/router.md
note where vLLM's lax pydantic parsing would coerce instead.

What the *emulated* engine cannot honour (beam search, tools, …) is the engine's
own table (``bidir_kv.engine.fields``); a router forwards those to P unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from bidir_kv.intake.errors import InputError

__all__ = ["BOOLEAN_FIELDS", "MAX_LOGPROBS", "check_request", "effective_max_tokens"]

BOOLEAN_FIELDS: Final = (
    "stream",
    "ignore_eos",
    "return_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "add_generation_prompt",
    "add_special_tokens",
    "echo",
)
MAX_LOGPROBS: Final = 20  # vLLM's default max_logprobs


def _refuse(key: str, message: str) -> InputError:
    return InputError(400, message, key)


def _int(body: Mapping[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _refuse(key, f"'{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def effective_max_tokens(body: Mapping[str, Any], chat: bool) -> int | None:
    """The output bound a request asks for: chat prefers ``max_completion_tokens``;
    a completion without ``max_tokens`` gets OpenAI's and vLLM's default of 16."""
    if chat:
        bound = _int(body, "max_completion_tokens", 1)
        return bound if bound is not None else _int(body, "max_tokens", 1)
    if "max_tokens" not in body:
        return 16
    return _int(body, "max_tokens", 1)


def _check_types(body: Mapping[str, Any]) -> None:
    for key in BOOLEAN_FIELDS:
        value = body.get(key)
        if value is not None and not isinstance(value, bool):
            raise _refuse(key, f"'{key}' must be a boolean, got {value!r}")
    _int(body, "n", 1)
    _int(body, "seed", 0)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, Mapping):
        raise _refuse("stream_options", f"'stream_options' must be an object, got {opts!r}")
    stop = body.get("stop")
    if (
        stop is not None
        and not isinstance(stop, str)
        and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise _refuse("stop", f"'stop' must be a string or a list of strings, got {stop!r}")
    ids = body.get("stop_token_ids")
    if ids is not None and not (
        isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        raise _refuse("stop_token_ids", f"'stop_token_ids' must be a list of integers, got {ids!r}")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _refuse("cache_salt", f"'cache_salt' must be a non-empty string, got {salt!r}")


def _check_logprobs(body: Mapping[str, Any], chat: bool) -> None:
    if chat:
        value = body.get("logprobs")
        if value is not None and not isinstance(value, bool):
            raise _refuse("logprobs", f"'logprobs' must be a boolean, got {value!r}")
        top = _int(body, "top_logprobs", 0)
        if top and not value:
            raise _refuse("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        name = "top_logprobs"
    else:
        top = _int(body, "logprobs", 0)
        name = "logprobs"
    if top is not None and top > MAX_LOGPROBS:
        raise _refuse(name, f"'{name}' must be at most {MAX_LOGPROBS}, got {top}")


def check_request(body: Mapping[str, Any], chat: bool) -> None:
    """Raise :class:`InputError` (400, naming the field) for a value vLLM refuses."""
    _check_types(body)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise _refuse("messages", "'messages' must be a list of message objects")
    elif "prompt" not in body:
        raise _refuse("prompt", "'prompt' is required")
    _check_logprobs(body, chat)
    max_tokens = effective_max_tokens(body, chat)
    min_tokens = _int(body, "min_tokens", 0)
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise _refuse(
            "min_tokens", f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})"
        )
