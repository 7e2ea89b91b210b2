"""The continuation guard: how much of a new prompt provably equals what D holds.

vLLM never compares P's prompt with D's token sequence (docs/protocol.md §1.4,
§6.3), so a rewritten history, stripped reasoning or a shorter prompt can import KV
of the wrong tokens. :func:`reusable_prefix` is the check that makes reuse safe; the
block-hash-chain form lets a router or engine check without shipping token ids.
The same chain keys the emulated engine's prefix cache.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

__all__ = [
    "ROOT_HASH",
    "block_hashes",
    "common_prefix_tokens",
    "reusable_prefix",
    "reusable_prefix_by_hashes",
    "tail_hash",
    "verified_continuation",
]

ROOT_HASH = b"\x00" * 16


def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")


def common_prefix_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    x, y = _comparable(a[:n], b[:n])
    lo = 0
    # Compare in chunks of narrowing size: slices of two arrays of one type (or two
    # lists) compare at C speed, so a 16k-token prompt diverging mid-way costs a few
    # dozen slice comparisons, not thousands of single ones.
    for step in (4096, 256, 16, 1):
        while lo + step <= n and x[lo : lo + step] == y[lo : lo + step]:
            lo += step
    return lo


def _comparable(a: Sequence[int], b: Sequence[int]) -> tuple[Sequence[int], Sequence[int]]:
    """The two as sequences whose slices compare by value: arrays of one typecode
    (a router keeps D's ids as ``array('I')``), else lists."""
    if isinstance(a, array) and not isinstance(b, array):
        a, b = b, a  # make b the array, a the other
        swapped = True
    else:
        swapped = False
    if isinstance(b, array) and not (isinstance(a, array) and a.typecode == b.typecode):
        try:
            a = array(b.typecode, a)
        except (OverflowError, TypeError):  # ids the array cannot hold: compare lists
            a, b = list(a), list(b)
    elif not (isinstance(a, array) and isinstance(b, array)):
        a, b = (a if isinstance(a, list) else list(a)), (b if isinstance(b, list) else list(b))
    return (b, a) if swapped else (a, b)


def reusable_prefix(d_tokens: Sequence[int], prompt_tokens: Sequence[int], block_size: int) -> int:
    """Longest block-aligned prefix of ``prompt_tokens`` equal to D's sequence.

    0 on any mismatch before the first block boundary. Only whole blocks are
    reusable: KV of a block depends on every token in it and all before it.
    """
    _check_block_size(block_size)
    n = common_prefix_tokens(d_tokens, prompt_tokens)
    return n - n % block_size


def block_hashes(tokens: Sequence[int], block_size: int, parent: bytes = ROOT_HASH) -> list[bytes]:
    """Hash chain over the *full* blocks of ``tokens``.

    ``h[i] = H(h[i-1] || block_size || tokens[i*bs:(i+1)*bs])``, so equal hashes
    at index ``i`` mean equal tokens at positions ``[0, (i+1)*bs)`` (up to the
    hash's collision resistance). A trailing partial block has no hash.
    """
    _check_block_size(block_size)
    out: list[bytes] = []
    prev = parent
    size = block_size.to_bytes(4, "little")
    full = len(tokens) - len(tokens) % block_size
    head = tokens[:full]
    if full and min(head) < 0:
        raise ValueError(f"token ids must be non-negative, got {min(head)}")
    # one 8-byte-per-token buffer, sliced per block (a 24k-token prompt is 1,500 blocks)
    data = memoryview(array("Q", head).tobytes())
    step = block_size * 8
    for start in range(0, full * 8, step):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(size)
        h.update(data[start : start + step])
        prev = h.digest()
        out.append(prev)
    return out


def reusable_prefix_by_hashes(
    d_hashes: Sequence[bytes],
    prompt_tokens: Sequence[int],
    block_size: int,
    *,
    prompt_hashes: Sequence[bytes] | None = None,
) -> int:
    """:func:`reusable_prefix` when only D's block-hash chain is known.

    ``prompt_hashes`` is the prompt's own chain when the caller already has it (an
    engine keeps it for its prefix cache); it must be ``block_hashes(prompt_tokens)``.
    """
    mine = block_hashes(prompt_tokens, block_size) if prompt_hashes is None else prompt_hashes
    n = 0
    for ours, theirs in zip(mine, d_hashes, strict=False):
        if ours != theirs:
            break
        n += 1
    return n * block_size


def tail_hash(tokens: Sequence[int]) -> bytes:
    """Hash of the tokens of a partial block (the chain only covers full blocks)."""
    return hashlib.blake2b(array("Q", tokens).tobytes(), digest_size=16).digest()


def verified_continuation(
    owner_chain: Sequence[bytes],
    owner_tail: bytes,
    owner_num_tokens: int,
    prompt_tokens: Sequence[int],
    block_size: int,
    *,
    prompt_hashes: Sequence[bytes] | None = None,
) -> int:
    """Tokens at the start of ``prompt_tokens`` whose KV the owner provably holds.

    Whole matching blocks of the owner's chain (:func:`reusable_prefix_by_hashes`),
    plus the owner's partial last block when every full block matched and the prompt
    continues through it (its ``tail_hash`` over ``[full, owner_num_tokens)``).
    """
    verified = reusable_prefix_by_hashes(
        owner_chain, prompt_tokens, block_size, prompt_hashes=prompt_hashes
    )
    if (
        verified == len(owner_chain) * block_size
        and len(prompt_tokens) >= owner_num_tokens > verified
        and tail_hash(prompt_tokens[verified:owner_num_tokens]) == owner_tail
    ):
        verified = owner_num_tokens
    return verified
