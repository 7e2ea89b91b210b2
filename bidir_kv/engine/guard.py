"""Continuation guard on a pull: read only what the owner provably holds for *our* tokens.

vLLM never compares the reader's prompt with the owner's token sequence
(docs/protocol.md §1.4, §6.3): a rewritten or stripped history imports KV of other
tokens. Our engines exchange the owner's block-hash chain in the claim answer
(:class:`~bidir_kv.wire.params.HeldTokens`, the value our connector's D puts in its
params), and the reader caps the pull at the longest verified prefix (``--kv-guard off``
restores vLLM's behaviour).
"""

from __future__ import annotations

from collections.abc import Sequence

from bidir_kv.policy import verified_continuation
from bidir_kv.wire.params import HeldTokens

__all__ = ["verified_tokens"]


def verified_tokens(
    prompt: Sequence[int],
    prompt_chain: Sequence[bytes],
    owner: HeldTokens | None,
    block_size: int,
) -> int:
    """Tokens at the start of ``prompt`` whose KV the owner provably holds
    (``policy.verified_continuation``; ``prompt_chain`` is ``block_hashes(prompt)``,
    which the engine keeps). An owner whose claim answer names no tokens proves none."""
    if owner is None:
        return 0
    return verified_continuation(
        owner.chain, owner.tail, owner.num_tokens, prompt, block_size, prompt_hashes=prompt_chain
    )
