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
from typing import Any

import aiohttp

from bidir_kv.client import Completion
from bidir_kv.engine.model import BYTE_BASE, VOCAB_SIZE
from bidir_kv.testing.pd_client import completion_from_bytes

__all__ = ["Conversation", "Turn", "body", "post", "random_tokens", "reference_ok"]


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """Token ids in the emulator's pseudo-word range (never special tokens)."""
    return [rng.randrange(BYTE_BASE, VOCAB_SIZE) for _ in range(n)]


def body(prompt: list[int], max_tokens: int, conv: str | None, *, stream: bool = True,
         model: str = "tiny") -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                           "stream": stream}
    if stream:
        out["stream_options"] = {"include_usage": True}
    if conv is not None:
        out["conversation_id"] = conv
    return out


async def post(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
               timeout: float = 120.0) -> Completion:
    """POST to ``{url}/v1/completions``; transport errors become ``status 0``."""
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=payload,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            raw = await resp.read()
            out = completion_from_bytes(resp.status, raw, bool(payload.get("stream")))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out = Completion(status=0, error=f"{type(exc).__name__}: {exc}")
    out.elapsed = time.perf_counter() - t0
    if out.ok and payload.get("stream") and out.finish_reason is None:
        out.error = "stream ended without a finish_reason"
    return out


async def reference_ok(session: aiohttp.ClientSession, ref_url: str | None, prompt: list[int],
                       max_tokens: int, got: list[int]) -> bool | None:
    """Whether ``got`` equals the reference engine's answer; ``None`` without a reference."""
    if ref_url is None:
        return None
    want = await post(session, ref_url, body(prompt, max_tokens, None, stream=False))
    if not want.ok:
        raise RuntimeError(f"reference engine failed: HTTP {want.status}: {want.error}")
    return want.token_ids == got


@dataclass
class Turn:
    """What the client saw for one turn."""

    index: int
    status: int
    elapsed: float
    correct: bool | None
    error: str | None = None


@dataclass
class Conversation:
    """A growing token history: first turn ``opening`` tokens, then ``new`` per turn."""

    cid: str | None
    rng: random.Random
    history: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def next_prompt(self, new: int) -> list[int]:
        return [*self.history, *random_tokens(self.rng, new)]

    async def turn(self, session: aiohttp.ClientSession, url: str, ref_url: str | None,
                   new: int, gen: int, *, stream: bool = True) -> Turn:
        prompt = self.next_prompt(new)
        res = await post(session, url, body(prompt, gen, self.cid, stream=stream))
        correct = None
        if res.ok:
            correct = await reference_ok(session, ref_url, prompt, gen, res.token_ids)
            self.history = [*prompt, *res.token_ids]
        t = Turn(len(self.turns), res.status, res.elapsed, correct, res.error)
        self.turns.append(t)
        return t
