"""Continuation guard: reuse D's KV only for a prompt that provably continues it.

vLLM pairs blocks by suffix trimming and compares no tokens (docs/protocol.md §6), so the
router checks: P's tokenization of the new prompt must start with the first
``remote_num_tokens`` tokens of D's sequence (prompt + generated ids of the last
turn). When it does not, and the block size is known, the hit is cut down to the
block-aligned common prefix (:func:`bidir_kv.policy.reusable_prefix`); otherwise
the hit becomes a *release*: ``remote_num_tokens = 0`` makes P's pull count
``<= 0``, so P only notifies D, which frees its pinned blocks early instead of
holding them for the whole TTL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bidir_kv.policy import common_prefix_tokens, reusable_prefix
from bidir_kv.protocol import KVTransferParams

__all__ = ["GuardVerdict", "judge_continuation", "release_params"]


@dataclass(frozen=True, slots=True)
class GuardVerdict:
    """``params`` to send P (``None``: reject); ``reason`` for logs and metrics."""

    params: KVTransferParams | None
    reason: str
    reusable_tokens: int = 0

    @property
    def accepted(self) -> bool:
        return self.params is not None


def release_params(params: KVTransferParams) -> KVTransferParams:
    """D's hit dict that makes P notify D without reading anything."""
    return params.with_fields(remote_num_tokens=0)


def judge_continuation(
    params: KVTransferParams,
    d_tokens: Sequence[int] | None,
    prompt_tokens: Sequence[int],
    block_size: int | None,
) -> GuardVerdict:
    """Decide how much of D's cached KV the new prompt may reuse."""
    r = params.num_remote_tokens
    if r <= 0:
        return GuardVerdict(params, "nothing-to-reuse")
    if d_tokens is None or len(d_tokens) < r:
        return GuardVerdict(None, "unverifiable")
    held = d_tokens[:r]
    if len(prompt_tokens) >= r and common_prefix_tokens(held, prompt_tokens) == r:
        return GuardVerdict(params, "continuation", r)
    reason = "shorter-prompt" if len(prompt_tokens) < r else "mismatch"
    groups = params.remote_block_ids or []
    if block_size and len(groups) == 1:
        n = reusable_prefix(held, prompt_tokens, block_size)
        keep = n // block_size
        if keep > 0 and keep <= len(groups[0]):
            trimmed = params.with_fields(
                remote_block_ids=[groups[0][:keep]], remote_num_tokens=keep * block_size
            )
            return GuardVerdict(trimmed, f"trimmed-{reason}", keep * block_size)
    return GuardVerdict(None, reason)
