"""Continuation guard: reuse D's KV only for a prompt that provably continues it.

vLLM pairs blocks by suffix trimming and compares no tokens (docs/protocol.md §6), so the
router checks: P's tokenization of the new prompt must start with the first
``remote_num_tokens`` tokens of D's sequence (prompt + generated ids of the last
turn). When it does not, and the block size is known, the hit is cut down to the
block-aligned common prefix (:func:`bidir_kv.policy.reusable_prefix`), every KV cache
group where its attention allows (:func:`bidir_kv.policy.trim_groups`); otherwise
the hit becomes a *release*: ``remote_num_tokens = 0`` makes P's pull count
``<= 0``, so P only notifies D, which frees its pinned blocks early instead of
holding them for the whole TTL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bidir_kv.policy import GroupRefusal, block_align_down, common_prefix_tokens, trim_groups
from bidir_kv.protocol import KVTransferParams
from bidir_kv.wire.params import groups_of

__all__ = ["GuardVerdict", "judge_continuation", "release_params"]

# the prompt shares no whole block with D, or runs past D's lists: the plain reason
_NOTHING_TO_CUT = frozenset({GroupRefusal.NOTHING, GroupRefusal.BEYOND_HELD})


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
    common = common_prefix_tokens(held, prompt_tokens)  # once: the check and the cut
    if len(prompt_tokens) >= r and common == r:
        return GuardVerdict(params, "continuation", r)
    reason = "shorter-prompt" if len(prompt_tokens) < r else "mismatch"
    groups = params.remote_block_ids or []
    if block_size and groups:
        n = block_align_down(common, block_size)  # policy.reusable_prefix's cut
        # every KV cache group cut where its attention allows (policy.trim_groups); D's
        # groups are described by our D only, several without it are refused
        cut = trim_groups(groups, n, block_size, groups_of(params.extra))
        if cut.ok:
            trimmed = params.with_fields(remote_block_ids=cut.block_ids, remote_num_tokens=n)
            return GuardVerdict(trimmed, f"trimmed-{reason}", n)
        if cut.reason not in _NOTHING_TO_CUT:
            return GuardVerdict(None, cut.reason)
    return GuardVerdict(None, reason)
