"""Pure rules of bidirectional KV transfer, shared by engine, router, planner and tests.

Nothing here does I/O or reads a clock: time comes in as ``now`` arguments.

Reading path: ``threshold`` (P's pull-or-recompute decision), ``blocks`` (block
arithmetic and pairing), ``groups`` (which blocks of each KV cache group a reuse
needs), ``retention`` (how long blocks are held, when a reader declines), ``guard``
(what a prompt provably shares with D), then ``cache_entry``, ``conversation_lease``
and ``placement`` (the router's rules).
"""

from bidir_kv.policy.blocks import (
    block_align_down,
    blocks_for_tokens,
    cdiv,
    max_prefix_hit_blocks,
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
from bidir_kv.policy.conversation_lease import (
    lease_deadline,
    lease_expired,
    valid_conversation_lease,
)
from bidir_kv.policy.groups import (
    NULL_BLOCK,
    GroupKind,
    GroupRefusal,
    GroupTrim,
    KVGroup,
    exported_window_blocks,
    trim_groups,
    window_block_range,
)
from bidir_kv.policy.guard import (
    ROOT_HASH,
    block_hashes,
    common_prefix_tokens,
    reusable_prefix,
    reusable_prefix_by_hashes,
    tail_hash,
    verified_continuation,
)
from bidir_kv.policy.peers import PeerAllowlist, peer_entries
from bidir_kv.policy.placement import least_loaded, node_load
from bidir_kv.policy.retention import (
    DEFAULT_DECODER_KV_BLOCKS_TTL,
    DEFAULT_KV_LEASE_DURATION,
    EXPIRY_SAFETY_MARGIN,
    HandshakeSample,
    LeaseTable,
    Release,
    RetentionLedger,
    clock_offset,
    deadline_offset,
    heartbeat_extension,
    heartbeat_interval,
    local_deadline,
    read_window,
    remote_deadline,
    retained_eviction_order,
    retention_budget_blocks,
    retention_budget_releases,
    should_decline,
    valid_lease_duration,
    valid_retention_ttl,
)
from bidir_kv.policy.threshold import (
    DEFAULT_RECOMPUTE_THRESHOLD,
    PullDecision,
    PullReason,
    below_threshold,
    capped_pull_tokens,
    pull_decision,
    threshold_enabled,
)

__all__ = [
    "DEFAULT_DECODER_KV_BLOCKS_TTL",
    "DEFAULT_KV_LEASE_DURATION",
    "DEFAULT_RECOMPUTE_THRESHOLD",
    "EXPIRY_SAFETY_MARGIN",
    "NULL_BLOCK",
    "ROOT_HASH",
    "GroupKind",
    "GroupRefusal",
    "GroupTrim",
    "HandshakeSample",
    "KVGroup",
    "LeaseTable",
    "PeerAllowlist",
    "PullDecision",
    "PullReason",
    "Release",
    "RetentionLedger",
    "below_threshold",
    "block_align_down",
    "block_hashes",
    "blocks_for_tokens",
    "cache_ttl_below_retention",
    "cache_ttl_within_retention",
    "capped_pull_tokens",
    "cdiv",
    "clock_offset",
    "common_prefix_tokens",
    "deadline_offset",
    "entry_age",
    "entry_is_stale",
    "exported_window_blocks",
    "heartbeat_extension",
    "heartbeat_interval",
    "lease_deadline",
    "lease_expired",
    "least_loaded",
    "local_deadline",
    "max_prefix_hit_blocks",
    "node_load",
    "partial_tail_tokens",
    "peer_entries",
    "position_pairing",
    "pull_decision",
    "read_window",
    "remote_deadline",
    "retained_eviction_order",
    "retention_budget_blocks",
    "retention_budget_releases",
    "reusable_prefix",
    "reusable_prefix_by_hashes",
    "scaled_cache_ttl",
    "should_decline",
    "stale_cutoff",
    "suffix_trim_pairing",
    "tail_hash",
    "target_block_range",
    "threshold_enabled",
    "trim_groups",
    "valid_conversation_lease",
    "valid_lease_duration",
    "valid_retention_ttl",
    "verified_continuation",
    "window_block_range",
]
