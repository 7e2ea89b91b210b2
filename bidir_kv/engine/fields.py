"""What the emulated engine does with each field of vLLM's OpenAI-compatible requests.

Why a table: a client sending a field the engine silently ignores would measure
something other than it asked for. Every field of vLLM's ``ChatCompletionRequest`` and
``CompletionRequest`` (vLLM 0.33, ``vllm/entrypoints/openai/*/protocol.py``) is in
exactly one of three sets:

* :data:`HONOURED`: parsed by ``api.py`` and acted on;
* :data:`NO_EFFECT`: accepted (type-checked) and irrelevant to the emulated model,
  which decodes greedily and deterministically (sampling knobs, metadata);
* :data:`REFUSED`: accepted only at its neutral value (``None``, ``false``, empty, or
  the value named here); any other value is a 400 naming the field.

Unknown fields are ignored, as vLLM ignores them (it logs a warning).
``docs/engine.md`` lists the same sets; ``suites/unit/test_engine_request_fields.py``
checks that the table covers vLLM's fields and that the docs list it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["HONOURED", "NO_EFFECT", "NUMERIC_NO_EFFECT", "REFUSED", "refused_field"]

HONOURED = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "stream",
        "stream_options",
        "stop",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "min_tokens",
        "seed",
        "logprobs",
        "top_logprobs",
        "skip_special_tokens",
        "add_generation_prompt",
        "add_special_tokens",
        "chat_template_kwargs",
        "cache_salt",
        "kv_transfer_params",
        "return_token_ids",
    }
)

# Numbers the emulated model does not use (greedy, deterministic decoding).
NUMERIC_NO_EFFECT = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "length_penalty",
        "priority",
        "stream_interval",
        "routed_experts_prompt_start",
        "thinking_token_budget",
    }
)

NO_EFFECT = NUMERIC_NO_EFFECT | frozenset(
    {
        "user",
        "request_id",
        "session_id",
        "spaces_between_special_tokens",
        "truncation_side",
        "parallel_tool_calls",
        "include_reasoning",
        "reasoning_effort",
        "media_io_kwargs",
        "mm_processor_kwargs",
    }
)

# field -> extra neutral values besides None / False / "" / [] / {}
REFUSED: Mapping[str, tuple[Any, ...]] = {
    "echo": (),
    "documents": (),
    "suffix": (),
    "logit_bias": (),
    "response_format": ({"type": "text"},),
    "tools": (),
    "tool_choice": ("none", "auto"),
    "use_beam_search": (),
    "prompt_logprobs": (),
    "logprob_token_ids": (),
    "allowed_token_ids": (),
    "bad_words": (),
    "continue_final_message": (),
    "chat_template": (),
    "truncate_prompt_tokens": (),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "best_of": (1,),
    "return_tokens_as_token_ids": (),
    "return_token_offsets": (),
    "return_prompt_text": (),
    "mm_payload": (),
    "return_mm_kwargs": (),
    "ec_transfer_params": (),
    "vllm_xargs": (),
    "repetition_detection": (),
    "prompt_embeds": (),
    "watermarking": (),
}


def _neutral(key: str, value: Any) -> bool:
    if value is None or value is False or (isinstance(value, str | list | dict) and not value):
        return True
    return any(value == v and type(value) is type(v) for v in REFUSED[key])


def refused_field(body: Mapping[str, Any]) -> str | None:
    """The message of the first field the engine cannot honour, else ``None``."""
    for key in REFUSED:
        if key in body and not _neutral(key, body[key]):
            return (
                f"'{key}' is not supported by the emulated engine "
                f"(got {body[key]!r}; docs/engine.md lists the supported fields)"
            )
    for key in NUMERIC_NO_EFFECT:
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            return f"'{key}' must be a number, got {v!r}"
    return None
