"""The emulated model: a deterministic tokenizer, a ChatML template, KV contents, sampling.

Why this shape: the suites need an engine whose output depends on its KV cache the
way a real model's does. So KV bytes of every token slot are a pure function of
(the token prefix up to that slot, layer), and the next token is a digest of the
KV bytes actually present in the pool. Pulling the wrong blocks (misaligned pairing,
expired and reused blocks, corrupted transfers) therefore changes the output, while
a correct disaggregated run reproduces a single engine token for token.

Tokenizer: ids 0-4 are the specials of the tiny model in docs/vllm-cpu.md §4.1
(``<|pad|> <|bos|> <|eos|> <|im_start|> <|im_end|>``), ids 5-260 are raw bytes and
ids 261.. are pseudo-words (``" " + word``). Generation samples only pseudo-words (and
EOS), so detokenized output re-tokenizes to the same ids and multi-turn text prompts
stay token-exact continuations.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from typing import Any, NamedTuple

import numpy as np

from bidir_kv.errors import IntakeError

__all__ = [
    "BOS",
    "BYTE_BASE",
    "EOS",
    "IM_END",
    "IM_START",
    "PAD",
    "SPECIALS",
    "VOCAB_SIZE",
    "WORDS",
    "WORD_BASE",
    "ChatTemplateError",
    "KVContent",
    "Tokenizer",
    "content_text",
    "fingerprints",
    "next_token",
    "render_chat",
]

PAD, BOS, EOS, IM_START, IM_END = 0, 1, 2, 3, 4
SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
BYTE_BASE = 5
WORD_BASE = BYTE_BASE + 256
VOCAB_SIZE = 1024

_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "ta",
    "vo",
    "shi",
    "pa",
    "de",
    "zu",
    "fe",
    "go",
    "bi",
    "lu",
    "so",
)


def _make_words(n: int) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for a in _SYLLABLES:
        seen.setdefault(a)
    for a in _SYLLABLES:
        for b in _SYLLABLES:
            seen.setdefault(a + b)
    for a in _SYLLABLES:
        for b in _SYLLABLES:
            for c in _SYLLABLES:
                if len(seen) >= n:
                    return tuple(seen)
                seen.setdefault(a + b + c)
    return tuple(seen)[:n]


WORDS: tuple[str, ...] = _make_words(VOCAB_SIZE - WORD_BASE)
_WORD_ID = {w: WORD_BASE + i for i, w in enumerate(WORDS)}
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIALS))
_PIECE_RE = re.compile(r" [a-z]+|[^ ]+| ")


_PIECE_CACHE_SIZE = 1 << 16  # distinct pieces remembered (bounded memory)
_PIECE_CACHE_MAX_LEN = 64  # longer pieces (rare runs of bytes) are not remembered
_PIECE_IDS: dict[str, tuple[int, ...]] = {}
_RECENT_TEXTS_SIZE = 16  # whole texts remembered (insertion order; the oldest goes first)


class _Encoded(NamedTuple):
    ids: tuple[int, ...]
    head: str  # the text up to the end of its last special token ("" if none)
    head_ids: int  # how many of ids encode head


_RECENT_TEXTS: dict[tuple[str, bool], _Encoded] = {}


def _piece_ids(piece: str) -> tuple[int, ...]:
    """Ids of one regex piece: a known pseudo-word, else its UTF-8 bytes."""
    wid = _WORD_ID.get(piece[1:]) if piece[0] == " " and len(piece) > 1 else None
    if wid is not None:
        return (wid,)
    return tuple(BYTE_BASE + b for b in piece.encode("utf-8"))


class ChatTemplateError(IntakeError, ValueError):
    """A ``messages`` list the template cannot render; the message names the problem."""


class Tokenizer:
    """Deterministic byte/pseudo-word tokenizer (no files, no training)."""

    vocab_size = VOCAB_SIZE
    bos_token_id = BOS
    eos_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings map to their ids.

        Recent texts are remembered: a router's ``/tokenize`` of a prompt is followed
        by the same prompt's request, and a next turn repeats the previous prompt up
        to a special token, where plain text is split anyway (only the rest is
        encoded)."""
        known = _RECENT_TEXTS.get((text, add_special_tokens))
        if known is not None:
            return list(known.ids)
        head = self._known_head(text, add_special_tokens)
        out = list(head.ids[: head.head_ids]) if head else [BOS] if add_special_tokens else []
        pos = len(head.head) if head else 0
        cut, cut_ids = pos, len(out)
        for m in _SPECIAL_RE.finditer(text, pos):
            self._encode_plain(text[pos : m.start()], out)
            out.append(SPECIALS.index(m.group()))
            pos = cut = m.end()
            cut_ids = len(out)
        self._encode_plain(text[pos:], out)
        _RECENT_TEXTS[(text, add_special_tokens)] = _Encoded(tuple(out), text[:cut], cut_ids)
        while len(_RECENT_TEXTS) > _RECENT_TEXTS_SIZE:
            del _RECENT_TEXTS[next(iter(_RECENT_TEXTS))]
        return out

    @staticmethod
    def _known_head(text: str, add_special_tokens: bool) -> _Encoded | None:
        """The remembered text whose head (up to its last special token) is longest
        among those ``text`` starts with."""
        best = None
        for (_, special), enc in _RECENT_TEXTS.items():
            longer = best is None or len(enc.head) > len(best.head)
            if special == add_special_tokens and enc.head and longer and text.startswith(enc.head):
                best = enc
        return best

    @staticmethod
    def _encode_plain(text: str, out: list[int]) -> None:
        # memoized per piece: prompts repeat their words, a 24k-token history many times
        pieces = _PIECE_RE.findall(text)
        found = list(map(_PIECE_IDS.get, pieces))  # one C-level pass; None: not seen yet
        at = 0
        while True:
            try:
                at = found.index(None, at)
            except ValueError:
                break
            piece = pieces[at]
            found[at] = ids = _piece_ids(piece)
            if len(piece) <= _PIECE_CACHE_MAX_LEN and len(_PIECE_IDS) < _PIECE_CACHE_SIZE:
                _PIECE_IDS[piece] = ids
        out.extend(chain.from_iterable(found))  # type: ignore[arg-type]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        buf = bytearray()
        for t in ids:
            if t < BYTE_BASE:
                if not skip_special_tokens and t >= 0:
                    buf += SPECIALS[t].encode()
            elif t < WORD_BASE:
                buf.append(t - BYTE_BASE)
            elif t < VOCAB_SIZE:
                buf += b" " + WORDS[t - WORD_BASE].encode()
            else:
                raise ValueError(f"token id {t} is outside the vocabulary (size {VOCAB_SIZE})")
        return buf.decode("utf-8", errors="replace")

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """One string per id (``/tokenize``'s ``token_strs``)."""
        return [self.decode([t], skip_special_tokens=False) for t in self.check_ids(ids)]

    def check_ids(self, ids: Sequence[Any]) -> list[int]:
        """Validate a token-id prompt; raise naming the first bad id."""
        out = []
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < VOCAB_SIZE:
                raise ValueError(
                    f"prompt token {i} is {t!r}; token ids must be ints in [0, {VOCAB_SIZE})"
                )
            out.append(t)
        return out


def content_text(content: Any, index: int, separator: str = "") -> str:
    """A message's content as one string: a string, or its text parts joined.

    The builtin ChatML template joins parts with nothing; a Hugging Face template
    gets them joined with newlines, as vLLM does (``separator``).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ChatTemplateError(
                    f"messages[{index}].content: only text parts are supported, got {part!r}"
                )
            parts.append(str(part.get("text", "")))
        return separator.join(parts)
    raise ChatTemplateError(f"messages[{index}].content must be a string or a list of parts")


def render_chat(messages: Any, add_generation_prompt: bool = True) -> str:
    """ChatML-style template of the tiny model (docs/vllm-cpu.md §4.1)."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] must be an object with a string 'role'")
        out.append(f"<|im_start|>{msg['role']}\n{content_text(msg.get('content'), i)}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


# ---- KV contents -------------------------------------------------------------

_M64 = (1 << 64) - 1
_P = 0x9E3779B97F4A7C15  # odd, hence invertible mod 2**64
_PINV = pow(_P, -1, 1 << 64)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_SHORT_RUN = 8  # slots hashed in plain Python (cheaper than numpy below this)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, vectorised (uint64 wraps)."""
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class KVContent:
    """KV bytes of token slots, a pure function of (token prefix, layer).

    The prefix hash ``h_i = sum_j (t_j + 1) * P**(i-j) mod 2**64`` is computed
    vectorised from the previous slot's hash, so a 24k-token prefill costs a few
    numpy passes.
    """

    def __init__(self, num_layers: int, bytes_per_layer_slot: int) -> None:
        if num_layers <= 0 or bytes_per_layer_slot <= 0:
            raise ValueError("num_layers and bytes_per_layer_slot must be positive")
        self.num_layers = num_layers
        self.bytes_per_layer_slot = bytes_per_layer_slot
        self._words = -(-bytes_per_layer_slot // 8)
        self._pow = np.ones(1, dtype=np.uint64)
        self._inv = np.ones(1, dtype=np.uint64)
        self._layer_salt = _mix64(np.arange(1, num_layers + 1, dtype=np.uint64) * _GOLD)
        # odd multipliers: word w of a slot is seed * m_w, a bijection of the seed
        self._word_mult = _mix64(np.arange(1, self._words + 1, dtype=np.uint64) * _GOLD) | 1

    def _powers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self._pow) < n + 1:
            size = max(n + 1, 2 * len(self._pow))
            p = np.full(size, _P, dtype=np.uint64)
            p[0] = 1
            q = np.full(size, _PINV, dtype=np.uint64)
            q[0] = 1
            self._pow = np.cumprod(p, dtype=np.uint64)
            self._inv = np.cumprod(q, dtype=np.uint64)
        return self._pow, self._inv

    def prefix_hashes(self, tokens: Sequence[int], prev_hash: int) -> np.ndarray:
        """Hashes of the slots holding ``tokens``, given the hash of the slot before."""
        n = len(tokens)
        if n <= _SHORT_RUN:  # a decode step: h_i = h_(i-1) * P + t_i + 1, no numpy set-up
            out = np.empty(n, dtype=np.uint64)
            h = prev_hash & _M64
            for i, t in enumerate(tokens):
                h = (h * _P + t + 1) & _M64
                out[i] = h
            return out
        pw, inv = self._powers(n)
        # array("Q") converts a list of ints about 4x faster than np.asarray
        u = np.frombuffer(array("Q", tokens), dtype=np.uint64) + np.uint64(1)
        acc = np.cumsum(u * inv[:n], dtype=np.uint64)
        return pw[:n] * acc + np.uint64(prev_hash & _M64) * pw[1 : n + 1]

    def slots(self, hashes: np.ndarray) -> np.ndarray:
        """Slot bytes, shape ``(n, num_layers, bytes_per_layer_slot)`` uint8."""
        seeds = _mix64(hashes[:, None] ^ self._layer_salt[None, :])
        words = seeds[:, :, None] * self._word_mult[None, None, :]
        raw = words.view(np.uint8).reshape(len(hashes), self.num_layers, self._words * 8)
        return raw[:, :, : self.bytes_per_layer_slot]


_FP_WEIGHTS: dict[int, np.ndarray] = {}


def fingerprints(rows: np.ndarray) -> np.ndarray:
    """One uint64 per row of KV bytes (shape ``(k, nbytes)`` uint8): ``sum_i w_i * x_i``.

    Why this primitive: the next token must depend on every byte a pull delivered,
    but a cryptographic hash over a 24k-token history costs more CPU than the
    prefill it stands for. The rows are read as 8-byte words ``x_i`` (zero-padded)
    and weighted by fixed odd ``w_i``, so a change in any one word always changes
    the sum (mod 2**64) and a row of other tokens' KV collides with chance 2**-64:
    one vectorised pass, as sensitive to a wrong pull as the hash was.
    """
    k, nbytes = rows.shape
    pad = -nbytes % 8
    if pad:
        rows = np.concatenate([rows, np.zeros((k, pad), dtype=np.uint8)], axis=1)
    words = np.ascontiguousarray(rows).view(np.uint64)
    n = words.shape[1]
    w = _FP_WEIGHTS.get(n)
    if w is None:
        w = _FP_WEIGHTS[n] = _mix64(np.arange(1, n + 1, dtype=np.uint64) * _GOLD) | np.uint64(1)
    return np.asarray(words @ w, dtype=np.uint64)


def next_token(seq_digest: bytes, last_token: int, allow_eos: bool) -> int:
    """Greedy next token from a digest of the sequence's KV contents."""
    d = hashlib.blake2b(seq_digest, digest_size=8)
    d.update(last_token.to_bytes(4, "little"))
    v = int.from_bytes(d.digest(), "little")
    if allow_eos and v % 97 == 0:
        return EOS
    return WORD_BASE + (v >> 8) % len(WORDS)
