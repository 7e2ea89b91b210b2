"""Continuation guard on a pull: read only what the owner provably holds for *our* tokens.

vLLM never compares the reader's prompt with the owner's token sequence
(docs/protocol.md §1.4, §6.3): a rewritten or stripped history imports KV of other
tokens. Our engines exchange the owner's block-hash chain (``policy.block_hashes``)
in the claim answer, plus a hash of the tokens in its partial last block, and the
reader caps the pull at the longest verified prefix (``--kv-guard off`` restores
vLLM's behaviour).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bidir_kv.policy import tail_hash, verified_continuation

__all__ = ["HandleTokens", "tail_hash", "verified_tokens"]


@dataclass(frozen=True)
class HandleTokens:
    """What the owner of a handle holds, in hashes: full-block chain + partial tail."""

    chain: tuple[bytes, ...]
    tail: bytes
    num_tokens: int

    @classmethod
    def of(cls, tokens: Sequence[int], chain: Sequence[bytes], block_size: int) -> HandleTokens:
        n = len(tokens)
        full = n // block_size
        if len(chain) < full:
            raise ValueError(f"chain covers {len(chain)} blocks, {n} tokens need {full}")
        return cls(tuple(chain[:full]), tail_hash(tokens[full * block_size :]), n)

    def to_wire(self) -> dict[str, Any]:
        return {"chain": [h.hex() for h in self.chain], "tail": self.tail.hex(),
                "num_tokens": self.num_tokens}  # fmt: skip

    @classmethod
    def from_wire(cls, obj: Any) -> HandleTokens:
        try:
            return cls(
                tuple(bytes.fromhex(h) for h in obj["chain"]),
                bytes.fromhex(obj["tail"]),
                int(obj["num_tokens"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed handle tokens in claim answer: {exc}") from None


def verified_tokens(
    prompt: Sequence[int], prompt_chain: Sequence[bytes], owner: HandleTokens, block_size: int
) -> int:
    """Tokens at the start of ``prompt`` whose KV the owner provably holds
    (``policy.verified_continuation``; ``prompt_chain`` is ``block_hashes(prompt)``,
    which the engine keeps)."""
    return verified_continuation(owner.chain, owner.tail, owner.num_tokens, prompt,
                                 block_size, prompt_hashes=prompt_chain)
