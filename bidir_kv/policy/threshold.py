"""P's decision on a turn-2+ request: pull the history from D, or recompute it.

This is vLLM's rule (``get_num_new_matched_tokens`` in the pull scheduler,
docs/protocol.md §4.2) as a pure function: local prefix cache first (block-aligned), then
``count = min(remote_num_tokens, prompt_len) - local_hit``; ``count <= 0`` or
``0 < count < threshold`` recompute, anything else pulls. ``count == threshold``
pulls: the comparison is strictly less-than.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from bidir_kv.policy.blocks import block_align_down

__all__ = [
    "DEFAULT_RECOMPUTE_THRESHOLD",
    "PullDecision",
    "PullReason",
    "below_threshold",
    "capped_pull_tokens",
    "pull_decision",
    "threshold_enabled",
]

DEFAULT_RECOMPUTE_THRESHOLD = 64


class PullReason(StrEnum):
    PULL = "pull"
    NOTHING_REMOTE = "nothing-remote"  # count <= 0: P already has what D offers
    BELOW_THRESHOLD = "below-threshold"  # 0 < count < threshold
    INVALID_PARAMS = "invalid-params"  # remote fields missing: no transfer at all


@dataclass(frozen=True, slots=True)
class PullDecision:
    """Outcome of :func:`pull_decision`.

    ``tokens`` is the number of tokens read from D (0 unless ``pull``).
    ``notify_only`` means P still tells D it is done so D frees its retained
    blocks early, without reading anything.
    """

    pull: bool
    tokens: int
    notify_only: bool
    local_hit_tokens: int
    count: int
    reason: PullReason

    @property
    def recompute_tokens(self) -> int:
        """Tokens P computes itself before the prompt is complete (excluding back-off)."""
        return 0 if self.pull else max(self.count, 0)


def pull_decision(
    *,
    prompt_tokens: int,
    local_hit_tokens: int,
    remote_num_tokens: int | None,
    block_size: int,
    threshold: int = DEFAULT_RECOMPUTE_THRESHOLD,
    remote_valid: bool = True,
) -> PullDecision:
    """vLLM's D->P pull decision.

    ``local_hit_tokens`` is P's own prefix-cache hit; it is rounded down to a
    block boundary here. ``remote_num_tokens`` of ``None`` counts as 0.
    ``threshold <= 0`` disables the check. ``remote_valid`` is False when the
    params lack a required key or block ids: then there is no transfer and no
    notification (vLLM logs ``Got invalid KVTransferParams``).
    """
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    if local_hit_tokens < 0:
        raise ValueError(f"local_hit_tokens must be >= 0, got {local_hit_tokens}")
    if local_hit_tokens > prompt_tokens:
        raise ValueError(
            f"local_hit_tokens ({local_hit_tokens}) cannot exceed prompt_tokens ({prompt_tokens})"
        )
    if remote_num_tokens is not None and remote_num_tokens < 0:
        raise ValueError(f"remote_num_tokens must be >= 0, got {remote_num_tokens}")
    hit = block_align_down(local_hit_tokens, block_size)
    remote = remote_num_tokens or 0
    count = min(remote, prompt_tokens) - hit
    if not remote_valid:
        return PullDecision(False, 0, False, hit, count, PullReason.INVALID_PARAMS)
    if count <= 0:
        return PullDecision(False, 0, True, hit, count, PullReason.NOTHING_REMOTE)
    if below_threshold(count, threshold):
        return PullDecision(False, 0, True, hit, count, PullReason.BELOW_THRESHOLD)
    return PullDecision(True, count, False, hit, count, PullReason.PULL)


def threshold_enabled(threshold: int) -> bool:
    """Whether vLLM's recompute check is on: ``threshold <= 0`` turns it off."""
    return threshold > 0


def below_threshold(count: int, threshold: int) -> bool:
    """vLLM's recompute test on a pull of ``count`` tokens: ``count < threshold``.

    Strictly less-than, so ``count == threshold`` pulls; always False with the check
    off. :func:`pull_decision` applies it only to a positive count.
    """
    return threshold_enabled(threshold) and count < threshold


def capped_pull_tokens(*, count: int, verified: int, threshold: int, from_prefill: bool) -> int:
    """Tokens to read once a continuation guard proved only ``verified`` of ``count``.

    ``verified >= count`` keeps the decision. Otherwise the pull shrinks to
    ``max(verified, 0)``; on P's D->P read a shrunk pull below the threshold is not
    made at all (notify-only), which is what :func:`pull_decision` would have
    decided had it known. D's read of P's prefill (``from_prefill``) has no
    threshold in vLLM, so it only shrinks.
    """
    if verified >= count:
        return count
    capped = max(verified, 0)
    if not from_prefill and below_threshold(capped, threshold):
        return 0
    return capped
