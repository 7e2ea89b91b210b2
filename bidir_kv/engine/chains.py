"""Block-hash chains of recent sequences, reused for the blocks a new prompt shares.

Why: every request needs ``policy.block_hashes`` of its prompt (prefix cache, the
continuation guard), and a multi-turn prompt repeats the whole previous turn. A chain
entry depends only on the tokens up to its block's end (and the root), so the entries
of a remembered sequence hold for a new prompt as far as their tokens are equal; only
the rest is hashed. The match is checked token by token, never assumed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from bidir_kv.policy import block_hashes, common_prefix_tokens

__all__ = ["ChainMemo"]

MEMO_SEQUENCES = 32  # recent sequences remembered: one per active conversation is enough


class ChainMemo:
    """``block_hashes`` with the shared head of a recently finished sequence reused."""

    def __init__(self, block_size: int, size: int = MEMO_SEQUENCES) -> None:
        self.block_size = block_size
        self._recent: deque[tuple[bytes, list[int], list[bytes]]] = deque(maxlen=size)

    def chain(self, tokens: Sequence[int], root: bytes) -> list[bytes]:
        """Exactly ``block_hashes(tokens, block_size, root)``."""
        bs = self.block_size
        reuse, known = 0, None
        for r, seq, chain in self._recent:
            if r != root or list(seq[:bs]) != list(tokens[:bs]):
                continue
            if len(seq) <= len(tokens) and seq == list(tokens[: len(seq)]):
                n = len(chain)  # the usual next turn: one comparison in C
            else:
                n = min(common_prefix_tokens(seq, tokens) // bs, len(chain))
            if n > reuse:
                reuse, known = n, chain
        if known is None:
            return block_hashes(tokens, bs, root)
        head = known[:reuse]
        return head + block_hashes(tokens[reuse * bs :], bs, head[-1])

    def remember(self, tokens: Sequence[int], chain: Sequence[bytes], root: bytes) -> None:
        """Keep a sequence whose ``chain`` is ``block_hashes`` of (a prefix of) ``tokens``."""
        full = min(len(chain), len(tokens) // self.block_size)
        if full:
            self._recent.append((root, list(tokens[: full * self.block_size]), list(chain[:full])))
