"""Pure rules of bidirectional KV transfer, shared by engine, router, planner and tests.

Nothing here does I/O or reads a clock: time comes in as ``now`` arguments.
"""

from bidir_kv.policy.blocks import (
    block_align_down,
    blocks_for_tokens,
    cdiv,
    partial_tail_tokens,
    position_pairing,
    suffix_trim_pairing,
    target_block_range,
)
from bidir_kv.policy.cache_entry import (
    cache_ttl_below_retention,
    cache_ttl_within_retention,
    entry_age,
    entry_is_stale,
    scaled_cache_ttl,
    stale_cutoff,
)
from bidir_kv.policy.guard import (
    ROOT_HASH,
    block_hashes,
    common_prefix_tokens,
    reusable_prefix,
    reusable_prefix_by_hashes,
)
from bidir_kv.policy.retention import (
    DEFAULT_DECODER_KV_BLOCKS_TTL,
    DEFAULT_KV_LEASE_DURATION,
    EXPIRY_SAFETY_MARGIN,
    HandshakeSample,
    LeaseTable,
    Release,
    RetentionLedger,
    clock_offset,
    heartbeat_extension,
    heartbeat_interval,
    local_deadline,
    read_window,
    should_decline,
)
from bidir_kv.policy.threshold import (
    DEFAULT_RECOMPUTE_THRESHOLD,
    PullDecision,
    PullReason,
    pull_decision,
)

__all__ = [
    "DEFAULT_DECODER_KV_BLOCKS_TTL",
    "DEFAULT_KV_LEASE_DURATION",
    "DEFAULT_RECOMPUTE_THRESHOLD",
    "EXPIRY_SAFETY_MARGIN",
    "ROOT_HASH",
    "HandshakeSample",
    "LeaseTable",
    "PullDecision",
    "PullReason",
    "Release",
    "RetentionLedger",
    "block_align_down",
    "block_hashes",
    "blocks_for_tokens",
    "cache_ttl_below_retention",
    "cache_ttl_within_retention",
    "cdiv",
    "clock_offset",
    "common_prefix_tokens",
    "entry_age",
    "entry_is_stale",
    "heartbeat_extension",
    "heartbeat_interval",
    "local_deadline",
    "partial_tail_tokens",
    "position_pairing",
    "pull_decision",
    "read_window",
    "reusable_prefix",
    "reusable_prefix_by_hashes",
    "scaled_cache_ttl",
    "should_decline",
    "stale_cutoff",
    "suffix_trim_pairing",
    "target_block_range",
]
