"""The sweep's requests: vLLM's multi-turn benchmark body, streamed through the one client.

Timing and reading are :mod:`bidir_kv.client`'s (TTFT at the first non-empty content
delta, as vLLM's benchmark measures it; one ``json.loads`` per chunk); ``bench
--check-client`` measures how far the client stays from being the bottleneck.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bidir_kv.client import CHAT_PATH, AsyncNodeClient, Completion, MalformedResponse

__all__ = ["build_chat_body", "stream_chat"]


def build_chat_body(
    model: str,
    messages: Sequence[Mapping[str, str]],
    max_tokens: int,
    conversation_id: str | None,
    *,
    ignore_eos: bool = True,
    token_ids: bool = False,
) -> dict[str, Any]:
    """The request body vLLM's multi-turn benchmark sends (plus usage, ``ignore_eos`` and,
    with ``token_ids``, ``return_token_ids``: the reply's ids, for tokens reusable)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": list(messages),
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if token_ids:
        body["return_token_ids"] = True
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    return body


async def stream_chat(
    client: AsyncNodeClient,
    body: Mapping[str, Any],
    *,
    headers: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
) -> Completion:
    """POST ``body`` to the client's ``/v1/chat/completions`` and time the stream.

    Raises :class:`~bidir_kv.client.ClientError`: a non-2xx answer, no answer, or a
    stream without any content (no TTFT to record).
    """
    res = await client.complete(body, path=CHAT_PATH, headers=headers, timeout=timeout_s)
    res.raise_for_status()
    if res.ttft is None:
        raise MalformedResponse("stream ended without any content", url=res.url)
    return res
