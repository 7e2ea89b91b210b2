"""The emulated model's choice mapped onto the serving tokenizer, stop strings, logprobs.

Why: ``model.next_token`` picks among the builtin tokenizer's pseudo-words (or EOS). A
served tokenizer (``--tokenizer``) has other ids, so :class:`Vocab` maps the choice onto
ids that re-encode to themselves (``HFTokenizer.word_ids``): a multi-turn client's next
prompt stays a token-exact continuation. :class:`Vocab` also applies ``min_tokens``,
``ignore_eos`` and the rule that a turn never ends at its first token (no empty
content). :class:`TextState` detokenizes incrementally and applies ``stop`` strings
inside the step loop, so the finishing token (and ``usage``) is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from bidir_kv.engine.hf_tokenizer import IncrementalDetokenizer
from bidir_kv.engine.model import EOS, VOCAB_SIZE, WORD_BASE

__all__ = ["TextState", "Vocab", "emulated_logprobs"]


class Vocab:
    """The ids generation may produce under one tokenizer."""

    def __init__(self, word_ids: Sequence[int], eos_id: int | None) -> None:
        if not word_ids:
            raise ValueError("the tokenizer has no word ids the emulated model can generate")
        self.word_ids = tuple(word_ids)
        self.eos_id = eos_id

    @classmethod
    def of(cls, tokenizer: Any) -> Vocab:
        words = getattr(tokenizer, "word_ids", None)
        if words is None:
            return cls(range(WORD_BASE, VOCAB_SIZE), EOS)
        return cls(words(), tokenizer.eos_token_id)

    def choose(self, raw: int, *, may_end: bool, banned: frozenset[int], salt: int) -> int:
        """The id to emit for the model's raw choice (``EOS`` or a builtin word id)."""
        n = len(self.word_ids)
        if raw == EOS:
            if may_end and self.eos_id is not None:
                return self.eos_id
            index = (salt * 2654435761) % n  # a deterministic word instead of ending
        else:
            index = (raw - WORD_BASE) % n
        for step in range(n):
            tok = self.word_ids[(index + step) % n]
            if tok not in banned:
                return tok
        raise ValueError("every word id is a stop token")


class TextState:
    """Text of one request's output, token by token, with stop strings applied.

    ``pieces[i]`` is the text streamed with output token ``i``; ``tail`` what is
    flushed after the last one. Up to ``len(longest stop) - 1`` characters are held
    back while a stop string could still start in them, as vLLM does.
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int], bool], str],
        *,
        stops: Sequence[str] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        context: Sequence[int] = (),
    ) -> None:
        self._detok = IncrementalDetokenizer(decode, skip_special_tokens, context)
        self.stops = tuple(s for s in stops if s)
        self.include_stop = include_stop
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.pieces: list[str] = []
        self.tail = ""
        self.sent = 0
        self.matched: str | None = None

    @property
    def final(self) -> str:
        return "".join(self.pieces) + self.tail

    def push(self, token_id: int, check_stops: bool = True) -> bool:
        """Add one output id; ``True`` when a stop string completed (finish now)."""
        self._detok.push(token_id)
        text = self._detok.text
        start = max(0, self.sent - self._hold)
        for stop in self.stops if check_stops else ():
            at = text.find(stop, start)
            if at >= 0:
                self.matched = stop
                end = at + len(stop) if self.include_stop else at
                self.pieces.append(text[self.sent : end])
                self.sent = end
                return True
        safe = max(self.sent, len(text) - self._hold)
        self.pieces.append(text[self.sent : safe])
        self.sent = safe
        return False

    def finish(self) -> None:
        """Release the held-back text (nothing when a stop string matched)."""
        if self.matched is None:
            self._detok.flush()
            self.tail = self._detok.text[self.sent :]
            self.sent = len(self._detok.text)


def emulated_logprobs(token_id: int, position: int, top: int) -> tuple[float, list[int]]:
    """A deterministic logprob for the chosen id and ``top`` alternative ids.

    The emulated model has no distribution; these values have vLLM's shape and are
    stable per (token, position) so clients that parse them work.
    """
    h = (token_id * 2654435761 + position * 40503) % 1000
    chosen = -round(h / 4000.0, 6)
    alts = [(token_id + 7 * (k + 1)) % VOCAB_SIZE for k in range(top)]
    return (chosen if math.isfinite(chosen) else 0.0), alts
