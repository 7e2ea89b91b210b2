"""One client request as it moves through the legs, and its latency bookkeeping."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from bidir_kv.router.history import HISTORY_SOURCE, History
from bidir_kv.router.identity import ConversationKey, log_safe
from bidir_kv.router.metrics import RouterMetrics
from bidir_kv.wire.ids import RequestId

__all__ = ["TurnState", "conv_label", "record_client_gone", "record_first_byte"]

log = logging.getLogger("bidir_kv.router")


@dataclass
class TurnState:
    """State of one request; ``upstream`` sums the seconds spent waiting on engines."""

    rid: RequestId
    endpoint: str
    body: dict[str, Any]
    headers: dict[str, str]
    key: ConversationKey | None
    stream: bool
    guard: bool  # the continuation guard is on for this router
    t0: float = field(default_factory=time.perf_counter)
    prompt_tokens: list[int] | None = None  # P's tokenization of this turn's prompt
    tokenize_task: asyncio.Task[list[int]] | None = None
    upstream: float = 0.0
    first_byte: bool = False
    p_usage: dict[str, Any] | None = None  # ``usage`` of P's answer to the P leg
    fell_back: bool = False  # the P leg was retried as a miss
    p_trims: bool = False  # D's whole dict went to a P that verifies D's chain itself
    # the digests of a turn recognised by its history (no id); ``key`` is then the
    # lookup key, ``None`` before the first assistant message
    history: History | None = None
    # the store's clock when this turn took its entry: a close at or after it wins, and
    # the turn's new entry is released instead of stored (ConversationStore.put)
    since: float | None = None

    @property
    def conv(self) -> str:
        if self.key is None:
            return "-" if self.history is None else "history:new"
        return conv_label(self.key)

    @property
    def single_choice(self) -> bool:
        """One prompt, one answer: the only shape whose KV a next turn can continue."""
        if self.body.get("n", 1) not in (None, 1):
            return False
        prompt = self.body.get("prompt")
        return not (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int))

    @property
    def wants_ids(self) -> bool:
        """The guard will need this turn's token ids to verify the next one."""
        remembered = self.key is not None or self.history is not None
        return self.guard and remembered and self.single_choice

    def cancel_tokenize(self) -> None:
        """Drop the background tokenization (its ids will not be stored)."""
        if self.tokenize_task is not None:
            self.tokenize_task.cancel()
            self.tokenize_task = None


def conv_label(key: ConversationKey) -> str:
    """A key as one log line shows it (a history digest cut to 16 hex digits)."""
    if key.source == HISTORY_SOURCE:
        return "history:" + key.conversation_id[:16]
    return log_safe(key.conversation_id)


def record_first_byte(turn: TurnState, metrics: RouterMetrics) -> None:
    """Observe the router's own latency once, when the client's first byte goes out."""
    if not turn.first_byte:
        turn.first_byte = True
        added = time.perf_counter() - turn.t0 - turn.upstream
        metrics.added_latency.observe(max(0.0, added))


def record_client_gone(turn: TurnState, metrics: RouterMetrics) -> None:
    """The client closed its connection; nothing more to send (not an engine error)."""
    turn.cancel_tokenize()
    metrics.errors.labels("client_gone").inc()
    log.info("[%s] conv=%s: client went away before the answer was complete", turn.rid, turn.conv)
