"""Block arithmetic and how remote blocks are paired with local ones.

vLLM's worker pairs D's exported blocks with P's newly allocated blocks by
*suffix trimming* (keep the last N remote blocks). That is only right when P's
prompt starts with D's whole sequence; :func:`position_pairing` is the
position-correct alternative that pairs by token position.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "block_align_down",
    "blocks_for_tokens",
    "cdiv",
    "max_prefix_hit_blocks",
    "partial_tail_tokens",
    "position_pairing",
    "suffix_trim_pairing",
    "target_block_range",
]


def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")


def _check_tokens(name: str, n: int) -> None:
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` (the last one may be partial)."""
    _check_block_size(block_size)
    _check_tokens("num_tokens", num_tokens)
    return cdiv(num_tokens, block_size)


def block_align_down(num_tokens: int, block_size: int) -> int:
    """Round a token count down to a block boundary (what prefix caches can hit)."""
    _check_block_size(block_size)
    _check_tokens("num_tokens", num_tokens)
    return num_tokens - num_tokens % block_size


def partial_tail_tokens(num_tokens: int, block_size: int) -> int:
    """Tokens in the last, partial block (0 when ``num_tokens`` is block-aligned)."""
    _check_block_size(block_size)
    _check_tokens("num_tokens", num_tokens)
    return num_tokens % block_size


def target_block_range(local_hit_tokens: int, count: int, block_size: int) -> range:
    """Indices (in token-position block space) of the blocks P allocates for a pull.

    P already holds ``local_hit_tokens`` (block-aligned) and pulls ``count`` more:
    blocks ``h/bs`` up to ``cdiv(h + count, bs)``.
    """
    _check_block_size(block_size)
    _check_tokens("count", count)
    if local_hit_tokens % block_size:
        raise ValueError(
            f"local_hit_tokens must be block-aligned (block_size {block_size}), "
            f"got {local_hit_tokens}"
        )
    if count == 0:
        return range(local_hit_tokens // block_size, local_hit_tokens // block_size)
    return range(local_hit_tokens // block_size, cdiv(local_hit_tokens + count, block_size))


def suffix_trim_pairing(remote_block_ids: Sequence[int], num_local_blocks: int) -> list[int]:
    """vLLM's pairing: the *last* ``num_local_blocks`` of D's list, in order.

    Correct only when P's prompt is a continuation of D's whole sequence and
    ``remote_num_tokens <= prompt_len`` (docs/protocol.md §6.2); otherwise it
    silently pairs the wrong positions (suspected upstream defect 3).
    """
    _check_tokens("num_local_blocks", num_local_blocks)
    if num_local_blocks > len(remote_block_ids):
        raise ValueError(
            f"cannot pair {num_local_blocks} local blocks with "
            f"{len(remote_block_ids)} remote blocks"
        )
    if num_local_blocks == 0:
        return []
    return list(remote_block_ids[-num_local_blocks:])


def position_pairing(
    remote_block_ids: Sequence[int], local_hit_tokens: int, count: int, block_size: int
) -> list[int]:
    """Remote blocks holding token positions ``[h, h + count)``, in order.

    Block ``i`` of D's list holds positions ``[i*bs, (i+1)*bs)``, so the pull
    takes D's blocks ``h/bs .. cdiv(h+count, bs) - 1``. Raises if D does not hold
    that many blocks.
    """
    wanted = target_block_range(local_hit_tokens, count, block_size)
    if wanted.stop > len(remote_block_ids):
        raise ValueError(
            f"remote holds {len(remote_block_ids)} blocks, pull of tokens "
            f"[{local_hit_tokens}, {local_hit_tokens + count}) needs {wanted.stop}"
        )
    return [remote_block_ids[i] for i in wanted]


def max_prefix_hit_blocks(prompt_tokens: int, block_size: int) -> int:
    """Most full blocks a local prefix-cache hit may cover for a prompt.

    vLLM always recomputes at least the last prompt token (it samples from it), so
    a hit stops at ``(prompt_tokens - 1) // block_size`` blocks.
    """
    _check_block_size(block_size)
    _check_tokens("prompt_tokens", prompt_tokens)
    return max(prompt_tokens - 1, 0) // block_size
