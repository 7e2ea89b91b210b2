"""Tokens reusable per turn: the part of the new prompt D's retained KV can serve.

D retains a turn's prompt and its reply but the last sampled token (``remote_num_tokens``
= prompt + generated − 1). The next prompt can reuse the longest block-aligned prefix it
shares with that sequence (``policy.reusable_prefix``), or all of it when it continues
it exactly (the partial last block is read whole): what a perfect router and P could
read, whatever the client did to the history. ``bench`` computes it after each
point, outside the timed requests: the prompts' ids come from the serving engine's
``/tokenize`` with the same messages (the chat template the request used), the reply's
ids from the stream's ``token_ids`` (``return_token_ids``). A row then reports tokens
reused (P's ``external_kv_transfer``) against tokens reusable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bidir_kv.bench.stats import RequestRecord
from bidir_kv.client import NodeClient
from bidir_kv.policy import common_prefix_tokens, reusable_prefix

__all__ = ["ChatTokenizer", "SentTurn", "fill_reusable", "reusable_tokens"]

MessagesTokenizer = Callable[[Sequence[Mapping[str, str]]], list[int]]


@dataclass
class SentTurn:
    """What one request sent and got: how many history messages (the new user message
    included) and the reply's token ids (empty: the server returned none)."""

    record: RequestRecord
    messages: int
    output_ids: list[int] = field(default_factory=list)


class ChatTokenizer:
    """A serving engine's ``/tokenize`` of chat messages (``add_generation_prompt``)."""

    def __init__(self, url: str, model: str, timeout: float = 60.0) -> None:
        self.client = NodeClient(url, timeout=timeout)
        self.model = model

    def __call__(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": list(messages),
            "add_generation_prompt": True,
        }
        obj = self.client.post("/tokenize", body).raise_for_status().json_object()
        tokens = obj.get("tokens")
        if not isinstance(tokens, list):
            raise RuntimeError(f"{self.client.url}/tokenize returned no 'tokens'")
        return [int(t) for t in tokens]


def reusable_tokens(held: Sequence[int], prompt: Sequence[int], block_size: int) -> int:
    """The prompt tokens D's retained ``held`` can serve: every block the prompt shares
    with it, and D's partial last block too when the prompt continues all of ``held``
    (an exact continuation reads it whole; P recomputes from its end)."""
    if len(prompt) >= len(held) and common_prefix_tokens(held, prompt) == len(held):
        return len(held)
    return reusable_prefix(held, prompt, block_size)


def fill_reusable(
    conversations: Iterable[tuple[Sequence[Mapping[str, str]], Sequence[SentTurn]]],
    tokenize: MessagesTokenizer,
    block_size: int,
) -> None:
    """Set ``reusable_tokens`` on every later turn whose previous turn's ids are known:
    ``policy.reusable_prefix`` of the previous turn's retained sequence and this
    turn's prompt. A turn after a failed one, or after a reply without token ids,
    stays ``None`` (unknown); the first turn reuses nothing (0)."""
    for messages, turns in conversations:
        held: list[int] | None = []
        for sent in turns:
            prompt = tokenize(messages[: sent.messages])
            if held is not None:
                sent.record.reusable_tokens = reusable_tokens(held, prompt, block_size)
            if sent.record.ok and sent.output_ids:
                held = [*prompt, *sent.output_ids][: len(prompt) + len(sent.output_ids) - 1]
            else:
                held = None
