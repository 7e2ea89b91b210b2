"""Campaign requests: token-id prompts on ``/v1/completions``, greedy, as the oracle compares them.

Token ids instead of chat text keep tokenization out of every comparison: an answer
through the router is correct when its token ids equal the reference engine's for
the same prompt (the emulator's output is a digest of the KV actually present, so a
wrong, stale or misaligned block changes it).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from bidir_kv.client import AsyncNodeClient, ClientError, Completion, MalformedResponse, token_body
from bidir_kv.engine.model import BYTE_BASE, VOCAB_SIZE

__all__ = [
    "Clients",
    "Conversation",
    "TurnOutcome",
    "body",
    "post",
    "random_tokens",
    "reference_ok",
]


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """Token ids in the emulator's pseudo-word range (never special tokens)."""
    return [rng.randrange(BYTE_BASE, VOCAB_SIZE) for _ in range(n)]


def body(
    prompt: list[int],
    max_tokens: int,
    conv: str | None,
    *,
    stream: bool = True,
    model: str = "tiny",
) -> dict[str, Any]:
    return token_body(
        model, prompt, max_tokens, stream=stream, conversation_id=conv, include_usage=True
    )


class Clients:
    """One async client per node URL for a campaign run (router, reference, engines)."""

    def __init__(self, timeout: float = 120.0) -> None:
        self.timeout = timeout
        self._by_url: dict[str, AsyncNodeClient] = {}

    def __call__(self, url: str) -> AsyncNodeClient:
        client = self._by_url.get(url)
        if client is None:
            client = self._by_url[url] = AsyncNodeClient(url, timeout=self.timeout)
        return client

    async def __aenter__(self) -> Clients:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for client in self._by_url.values():
            await client.aclose()


async def post(
    clients: Clients, url: str, payload: dict[str, Any], timeout: float = 120.0
) -> Completion:
    """POST to ``{url}/v1/completions``; a non-2xx answer is returned, no answer (or a
    stream that ends without a ``finish_reason``) raises :class:`ClientError`."""
    out = await clients(url).complete(payload, timeout=timeout)
    if out.ok and out.stream and out.finish_reason is None:
        raise MalformedResponse("stream ended without a finish_reason", url=out.url)
    return out


async def reference_ok(
    clients: Clients, ref_url: str | None, prompt: list[int], max_tokens: int, got: list[int]
) -> bool | None:
    """Whether ``got`` equals the reference engine's answer; ``None`` without a reference."""
    if ref_url is None:
        return None
    want = await post(clients, ref_url, body(prompt, max_tokens, None, stream=False))
    want.raise_for_status()
    return want.token_ids == got


@dataclass
class TurnOutcome:
    """What the client saw for one turn: ``status`` is ``None`` when no answer came
    (``error`` then names the :class:`ClientError`)."""

    index: int
    status: int | None
    elapsed: float
    correct: bool | None
    error: str | None = None
    ttft: float | None = None  # streams: seconds to the first chunk with content

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300 and self.error is None

    @property
    def seen(self) -> str:
        """``HTTP <status>``, or the failure when no answer came."""
        return f"HTTP {self.status}" if self.status is not None else f"no answer ({self.error})"


@dataclass
class Conversation:
    """A growing token history: first turn ``opening`` tokens, then ``new`` per turn."""

    cid: str | None
    rng: random.Random
    history: list[int] = field(default_factory=list)
    turns: list[TurnOutcome] = field(default_factory=list)

    def next_prompt(self, new: int) -> list[int]:
        return [*self.history, *random_tokens(self.rng, new)]

    async def turn(
        self,
        clients: Clients,
        url: str,
        ref_url: str | None,
        new: int,
        gen: int,
        *,
        stream: bool = True,
    ) -> TurnOutcome:
        """One turn of ``new`` tokens more; checked by the oracle when ``ref_url`` is set."""
        prompt = self.next_prompt(new)
        t0 = time.perf_counter()
        try:
            res = await post(clients, url, body(prompt, gen, self.cid, stream=stream))
        except ClientError as exc:
            t = TurnOutcome(
                len(self.turns),
                None,
                time.perf_counter() - t0,
                None,
                f"{type(exc).__name__}: {exc}",
            )
            self.turns.append(t)
            return t
        correct = None
        if res.ok:
            correct = await reference_ok(clients, ref_url, prompt, gen, res.token_ids)
            self.history = [*prompt, *res.token_ids]
        t = TurnOutcome(len(self.turns), res.status, res.elapsed, correct, res.error, res.ttft)
        self.turns.append(t)
        return t
