"""Deterministic synthetic multi-turn conversations.

Same shape as the AWS blog's sweep (vLLM's ``generate_multi_turn.json`` with
constant distributions): N conversations × T turns, a per-conversation prefix of
``prefix_tokens`` in the first user message, ``input_tokens`` per later user
message and ``output_tokens`` per answer. Every conversation has its own text
(seeded per conversation), so prefix caches never share blocks between
conversations. Token counts are made exact with the server's tokenizer
(``/tokenize``) through a ``count`` callable; without one, words are counted.

``history`` is how a client sends the previous reply back in the next turn
(:func:`reply_in_history`): verbatim, as vLLM's benchmark does, or rewritten the
ways agentic clients rewrite it (replaced by a recorded text, cut to half, its
reasoning stripped).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from bidir_kv.bench.distributions import Distribution
from bidir_kv.errors import ConfigError

__all__ = [
    "HISTORY_MODES",
    "Conversation",
    "TokenCounter",
    "Turn",
    "WorkloadError",
    "WorkloadSpec",
    "build_conversations",
    "count_words",
    "fit_text",
    "reply_in_history",
]

TokenCounter = Callable[[str], int]

_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ne",
    "su",
    "ta",
    "ri",
    "po",
    "de",
    "fa",
    "gu",
    "he",
    "jo",
    "ve",
    "zu",
    "bi",
    "ro",
    "sa",
    "te",
    "nu",
)


class WorkloadError(ConfigError):
    """Bad workload parameters; the message names the parameter."""


# how the previous reply goes back into the next turn's history (reply_in_history)
HISTORY_MODES = ("verbatim", "replaced", "half", "no-think")
THINK_END = "</think>"


def reply_in_history(text: str, mode: str, key: str) -> str:
    """The assistant message a client sends back for the reply ``text``.

    ``verbatim``: the reply as received (vLLM's multi-turn benchmark). ``replaced``:
    another text of as many words, seeded by ``key`` (a benchmark threading recorded
    replies). ``half``: its first half (by characters: a trimmed tool output, a cut
    reply). ``no-think``: without its reasoning, as reasoning templates send it back:
    the text after ``</think>`` when the reply has one, else its second half (a model
    without a reasoning parser's tags: the first half stands for the reasoning).
    """
    if mode == "verbatim":
        return text
    if mode == "replaced":
        return " ".join(_WordSource(random.Random(f"bidir-kv:reply:{key}")).take(len(text.split())))
    if mode == "half":
        return text[: len(text) // 2]
    if mode == "no-think":
        if THINK_END in text:
            return text.split(THINK_END, 1)[1].lstrip()
        return text[len(text) // 2 :].lstrip()
    raise WorkloadError(f"history must be one of {', '.join(HISTORY_MODES)}, got {mode!r}")


def count_words(text: str) -> int:
    """Fallback counter when no tokenizer endpoint is available: one token per word."""
    return len(text.split())


@dataclass(frozen=True)
class WorkloadSpec:
    """One sweep point. Think time is the gap before turns 2+ of a conversation."""

    prefix_tokens: int = 2000
    num_conversations: int = 10
    num_turns: int = 10
    input_tokens: int = 150
    output_tokens: int = 300
    think_time: Distribution = field(default_factory=lambda: Distribution("const", (0.0,)))
    beyond_ttl_fraction: float = 0.0
    beyond_ttl_gap_s: float = 0.0
    seed: int = 0
    history: str = "verbatim"  # how the previous reply is sent back (HISTORY_MODES)

    def __post_init__(self) -> None:
        if self.history not in HISTORY_MODES:
            raise WorkloadError(
                f"history must be one of {', '.join(HISTORY_MODES)}, got {self.history!r}"
            )
        for name in ("num_conversations", "num_turns", "input_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefix_tokens < 0:
            raise WorkloadError(f"prefix_tokens must be >= 0, got {self.prefix_tokens}")
        if not 0.0 <= self.beyond_ttl_fraction <= 1.0:
            raise WorkloadError(
                f"beyond_ttl_fraction must be in [0, 1], got {self.beyond_ttl_fraction}"
            )
        if self.beyond_ttl_fraction > 0 and self.beyond_ttl_gap_s <= 0:
            raise WorkloadError("beyond_ttl_fraction > 0 needs beyond_ttl_gap_s > 0")


@dataclass(frozen=True)
class Turn:
    index: int
    content: str
    content_tokens: int
    max_tokens: int
    think_time_s: float
    beyond_ttl: bool = False


@dataclass(frozen=True)
class Conversation:
    conversation_id: str
    prefix_tokens: int
    turns: tuple[Turn, ...]
    history: str = "verbatim"  # how its client sends each reply back (reply_in_history)


class _WordSource:
    """An endless deterministic stream of pseudo-words."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self.words: list[str] = []

    def take(self, n: int) -> list[str]:
        while len(self.words) < n:
            k = self._rng.randint(1, 3)
            self.words.append("".join(self._rng.choice(_SYLLABLES) for _ in range(k)))
        return self.words[:n]


def fit_text(
    target: int, rng: random.Random, count: TokenCounter = count_words, head: str = ""
) -> tuple[str, int]:
    """Text of ``target`` tokens under ``count`` (closest reachable; exact for most tokenizers).

    Starts from one word per token and corrects proportionally, so a tokenizer
    that is unknown here still converges in a few calls.
    """
    if target < 1:
        raise WorkloadError(f"a message needs at least 1 token, got {target}")
    src = _WordSource(rng)
    head_words = head.split() if head and count(head) * 2 < target else []

    def text_of(n: int) -> str:
        return " ".join([*head_words, *src.take(n)])

    n = max(1, target - len(head_words))
    seen: dict[int, int] = {}
    for _ in range(16):
        c = count(text_of(n))
        seen[n] = c
        if c == target:
            break
        step = round((target - c) * n / max(c, 1))
        if step == 0:
            step = 1 if c < target else -1
        nxt = max(1, n + step)
        if nxt in seen:
            # oscillating around the target: walk one word at a time towards it
            nxt = max(1, n + (1 if c < target else -1))
            if nxt in seen:
                break
        n = nxt
    best = min(seen, key=lambda k: (abs(seen[k] - target), seen[k] > target))
    if seen[best] == target:
        return text_of(best), target
    # Sub-word tokenizers (byte-level BPE, the emulator's): trim characters of a
    # slightly longer text until the count lands on the target.
    longer = (
        max(k for k in seen if seen[k] >= target) if any(seen[k] >= target for k in seen) else None
    )
    if longer is None:
        return text_of(best), seen[best]
    text = text_of(longer)
    lo, hi = 1, len(text)  # count(text[:hi]) >= target
    found: tuple[str, int] | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        cand = text[:mid]
        c = count(cand)
        if c == target:
            found = (cand, c)
            break
        if c < target:
            lo = mid + 1
        else:
            hi = mid - 1
    if found is not None:
        return found
    return text_of(best), seen[best]


def build_conversations(
    spec: WorkloadSpec, count: TokenCounter = count_words
) -> list[Conversation]:
    """The conversations of one sweep point; identical for the same spec and tokenizer."""
    out: list[Conversation] = []
    for i in range(spec.num_conversations):
        key = f"bidir-kv:{spec.seed}:{spec.prefix_tokens}:{i}"
        gap_rng = random.Random(f"{key}:gaps")
        cid = f"conv-s{spec.seed}-p{spec.prefix_tokens}-{i:03d}"
        turns: list[Turn] = []
        for t in range(spec.num_turns):
            target = spec.input_tokens + (spec.prefix_tokens if t == 0 else 0)
            tag = hashlib.sha1(key.encode()).hexdigest()[:12]
            head = f"{tag} {cid} turn {t + 1}:" if t == 0 else f"turn {t + 1}:"
            text, ntok = fit_text(target, random.Random(f"{key}:{t}"), count, head=head)
            beyond = t > 0 and gap_rng.random() < spec.beyond_ttl_fraction
            if t == 0:
                gap = 0.0
            elif beyond:
                gap = spec.beyond_ttl_gap_s
            else:
                gap = spec.think_time.sample(gap_rng)
            turns.append(
                Turn(
                    index=t,
                    content=text,
                    content_tokens=ntok,
                    max_tokens=spec.output_tokens,
                    think_time_s=gap,
                    beyond_ttl=beyond,
                )
            )
        out.append(Conversation(cid, spec.prefix_tokens, tuple(turns), spec.history))
    return out
