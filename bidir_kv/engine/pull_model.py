"""How long a D→P pull takes on a target network: the one formula emulator and planner share.

A pull of ``n`` tokens is what every tensor-parallel rank of P reads from its peer
rank of D, all ranks at once; it finishes when the (identical) ranks finish, so
the time is one rank's:

    wire(n) = fixed + descriptors(n) × per_descriptor + rank_bytes(n) / rank_bandwidth

* ``descriptors(n)`` = blocks(n) × ``descriptors_per_block``: vLLM's NIXL connector
  posts one RDMA descriptor per block per layer per KV tensor (K and V for GQA, the
  latent and the indexer keys for MLA with sparse attention) on every rank.
* ``rank_bandwidth`` = ``rail_gbytes_per_s`` × ``rails_per_rank``: the *achieved*
  rate of one rank-level transfer (vLLM's NIXL histograms count per rank).
* P notices the completion at the end of the engine step in flight and schedules
  the rest of the prefill in the next one: the planner adds half an idle step
  (``step_us`` / 2); the emulator's step loop produces the delay itself.
* The first pull between a new pair also pays ``handshake_us`` (NIXL agent metadata
  exchange); it is a one-off and left out of the steady-state break-even.

Derivation of every term for the shipped profiles: docs/profiles.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PullModel"]


@dataclass(frozen=True)
class PullModel:
    """The terms of one pull, microseconds and bytes; all ``0`` = a free pull."""

    fixed_us: float = 0.0  # per pull: descriptor list build, post, completion notification
    per_descriptor_us: float = 0.0  # submission cost of one RDMA descriptor on one rank
    rank_bytes_per_token: float = 0.0  # KV one rank reads per token
    rank_gbytes_per_s: float = 0.0  # achieved bandwidth of one rank-level transfer; 0 = free
    block_size: int = 16  # the target's KV block (tokens per descriptor)
    descriptors_per_block: int = 0  # per rank: layers × KV tensors
    step_us: float = 0.0  # one idle engine step of P (completion seen at step granularity)
    handshake_us: float = 0.0  # first pull between a new P/D pair only

    def descriptors(self, tokens: int) -> int:
        """Descriptors one rank posts for ``tokens`` tokens (whole blocks)."""
        if tokens <= 0:
            return 0
        return math.ceil(tokens / self.block_size) * self.descriptors_per_block

    @property
    def us_per_token(self) -> float:
        """Marginal cost of one more pulled token (bytes + its share of a block's descriptors)."""
        byte_us = (
            self.rank_bytes_per_token / (self.rank_gbytes_per_s * 1e3)
            if self.rank_gbytes_per_s > 0
            else 0.0
        )
        return byte_us + self.descriptors_per_block / self.block_size * self.per_descriptor_us

    def wire_us(self, tokens: float, whole_blocks: bool = True) -> float:
        """Post to completion of one pull; ``whole_blocks=False`` prorates a partial block."""
        if tokens <= 0:
            return 0.0
        blocks = math.ceil(tokens / self.block_size) if whole_blocks else tokens / self.block_size
        byte_us = (
            tokens * self.rank_bytes_per_token / (self.rank_gbytes_per_s * 1e3)
            if self.rank_gbytes_per_s > 0
            else 0.0
        )
        desc_us = blocks * self.descriptors_per_block * self.per_descriptor_us
        return self.fixed_us + desc_us + byte_us

    def pull_us(self, tokens: float) -> float:
        """What a pull adds to P's prefill: wire time + half an idle step (linear in tokens)."""
        if tokens <= 0:
            return 0.0
        return self.wire_us(tokens, whole_blocks=False) + self.step_us / 2
