"""The one key our connector adds to D's ``kv_transfer_params``: D's token chain.

vLLM's D-node dict says how many tokens D holds (``remote_num_tokens``) but not
which, so P cannot tell whether its prompt continues D's sequence (vLLM issue
#43094). Our D adds :data:`CHAIN_KEY`: the block-hash chain
(``policy.block_hashes``) over the full blocks of the tokens it holds, a hash of its
partial last block (``policy.tail_hash``) and the block size. Every other key, and
every byte below HTTP (NIXL side channel, READs, notifications), is vLLM's.
Routers pass the dict through verbatim; a stock vLLM P ignores the key (it reads
params with ``.get``), so a mixed pair behaves as stock vLLM does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bidir_kv.policy import block_hashes, tail_hash, valid_conversation_lease

__all__ = [
    "CHAIN_KEY",
    "CHAIN_VERSION",
    "LEASE_CONFIG_KEY",
    "LEASE_KEY",
    "LEASE_VERSION",
    "HeldTokens",
    "configured_lease",
    "lease_of",
    "lease_to_wire",
]

CHAIN_KEY = "bidir_kv_chain"
CHAIN_VERSION = 1  # bump when the value's shape or hash changes

# The renewable lease (docs/connector.md §6): D configured with
# ``kv_connector_extra_config.bidir_kv_lease_seconds`` advertises it in its dict as
# ``"bidir_kv_lease": {"v": 1, "idle_seconds": N}``, so a router knows to keep the
# conversation alive and free D's blocks (notify-only) once it goes idle. P ignores it.
LEASE_CONFIG_KEY = "bidir_kv_lease_seconds"
LEASE_KEY = "bidir_kv_lease"
LEASE_VERSION = 1


def configured_lease(value: object) -> float | None:
    """D's lease as configured under :data:`LEASE_CONFIG_KEY` (``None``: not set); one
    check for our config parser and for the connector reading vLLM's config."""
    if value is None:
        return None
    if isinstance(value, int | float) and valid_conversation_lease(value):
        return float(value)
    raise ValueError(f"kv_connector_extra_config.{LEASE_CONFIG_KEY}: must be a positive "
                     f"number of seconds, got {value!r}")


def lease_to_wire(idle_seconds: float) -> dict[str, Any]:
    """The value D adds under :data:`LEASE_KEY`."""
    return {"v": LEASE_VERSION, "idle_seconds": float(idle_seconds)}


def lease_of(params: Mapping[str, Any]) -> float | None:
    """The idle lease D advertised in a params dict; ``None`` when absent, of another
    version or not a positive number (the router then keeps the fixed TTL)."""
    obj = params.get(LEASE_KEY)
    if not isinstance(obj, Mapping) or obj.get("v") != LEASE_VERSION:
        return None
    idle = obj.get("idle_seconds")
    if isinstance(idle, int | float) and valid_conversation_lease(idle):
        return float(idle)
    return None


@dataclass(frozen=True)
class HeldTokens:
    """What D holds, in hashes: full-block chain, partial tail, count, block size."""

    chain: tuple[bytes, ...]
    tail: bytes
    num_tokens: int
    block_size: int

    @classmethod
    def of(cls, tokens: Sequence[int], block_size: int) -> HeldTokens:
        full = len(tokens) - len(tokens) % block_size
        return cls(tuple(block_hashes(tokens, block_size)), tail_hash(tokens[full:]),
                   len(tokens), block_size)

    def to_wire(self) -> dict[str, Any]:
        return {"v": CHAIN_VERSION, "block_size": self.block_size,
                "num_tokens": self.num_tokens, "tail": self.tail.hex(),
                "chain": [h.hex() for h in self.chain]}  # fmt: skip

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> HeldTokens | None:
        """D's chain from a params dict; ``None`` when absent, of another version or
        malformed (P then treats D's KV as unverified)."""
        obj = params.get(CHAIN_KEY)
        if not isinstance(obj, Mapping) or obj.get("v") != CHAIN_VERSION:
            return None
        try:
            held = cls(tuple(bytes.fromhex(h) for h in obj["chain"]), bytes.fromhex(obj["tail"]),
                       int(obj["num_tokens"]), int(obj["block_size"]))
        except (KeyError, TypeError, ValueError):
            return None
        if held.block_size <= 0 or len(held.chain) != held.num_tokens // held.block_size:
            return None
        return held
