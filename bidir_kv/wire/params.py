"""The keys our D adds to vLLM's ``kv_transfer_params``: its token chain and its lease.

vLLM's D-node dict says how many tokens D holds (``remote_num_tokens``) but not
which, so P cannot tell whether its prompt continues D's sequence (vLLM issue
#43094). Our D adds :data:`CHAIN_KEY`: the block-hash chain
(``policy.block_hashes``) over the full blocks of the tokens it holds, a hash of its
partial last block (``policy.tail_hash``) and the block size. Every other key, and
every byte below HTTP (NIXL side channel, READs, notifications), is vLLM's.
Routers pass the dict through verbatim; a stock vLLM P ignores the key (it reads
params with ``.get``), so a mixed pair behaves as stock vLLM does. Our emulated engine
answers a claim with the same :class:`HeldTokens` value. Both values carry their
version from :mod:`bidir_kv.wire.versions`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bidir_kv.policy import KVGroup, block_hashes, tail_hash, valid_conversation_lease
from bidir_kv.wire.versions import GROUPS, LEASE, TOKEN_CHAIN, VERIFY

__all__ = [
    "CHAIN_KEY",
    "GROUPS_KEY",
    "LEASE_CONFIG_KEY",
    "LEASE_KEY",
    "VERIFY_CONFIG_KEY",
    "VERIFY_KEY",
    "HeldTokens",
    "advertises_verify",
    "configured_lease",
    "groups_of",
    "groups_to_wire",
    "lease_of",
    "lease_to_wire",
    "verifier_advert",
]

CHAIN_KEY = "bidir_kv_chain"

# The renewable lease (docs/connector.md §6): D configured with
# ``kv_connector_extra_config.bidir_kv_lease_seconds`` advertises it in its dict as
# ``"bidir_kv_lease": {"v": 1, "idle_seconds": N}``, so a router knows to keep the
# conversation alive and free D's blocks (notify-only) once it goes idle. P ignores it.
LEASE_CONFIG_KEY = "bidir_kv_lease_seconds"
LEASE_KEY = "bidir_kv_lease"

# A reader that caps every pull at the prefix D's chain (CHAIN_KEY) proves says so in
# the dict it hands on with its prefill (P's dict to the router), the way the fence
# advert does: ``"bidir_kv_verify": {"v": 1, "chain": true}``. A router seeing it from a
# prefill node may forward D's whole dict for a rewritten history and let that P read
# the proven prefix; without it (stock vLLM) the router must trim or refuse itself.
VERIFY_KEY = "bidir_kv_verify"
# our vLLM connector's P verifies (and advertises it) unless its
# kv_connector_extra_config sets this to false
VERIFY_CONFIG_KEY = "bidir_kv_verify_continuation"


# D's KV cache groups, in the order of its remote_block_ids lists (docs/protocol.md §6.4):
# ``"bidir_kv_groups": {"v": 1, "groups": [{"kind": "full", "block_size": 16},
# {"kind": "sliding_window", "block_size": 16, "window": 4096}]}``. Only a D whose layout
# is not one full-attention group adds it; a router needs it to cut several lists to a
# prefix (policy.trim_groups) and refuses that cut without it.
GROUPS_KEY = "bidir_kv_groups"


def groups_to_wire(layout: Sequence[KVGroup]) -> dict[str, Any]:
    """The value D adds under :data:`GROUPS_KEY`."""
    groups: list[dict[str, Any]] = []
    for g in layout:
        item: dict[str, Any] = {"kind": str(g.kind), "block_size": g.block_size}
        if g.window is not None:
            item["window"] = g.window
        groups.append(item)
    return {"v": GROUPS.version, "groups": groups}


def groups_of(params: Mapping[str, Any] | None) -> tuple[KVGroup, ...] | None:
    """D's group layout from a params dict; ``None`` when absent, of another version or
    malformed (a router then treats several groups as an unknown layout)."""
    obj = params.get(GROUPS_KEY) if params else None
    if not isinstance(obj, Mapping) or obj.get("v") != GROUPS.version:
        return None
    items = obj.get("groups")
    if not isinstance(items, list) or not items:
        return None
    out = []
    for item in items:
        if not isinstance(item, Mapping):
            return None
        kind, bs, window = item.get("kind"), item.get("block_size"), item.get("window")
        if not isinstance(kind, str) or not _is_int(bs) or not (window is None or _is_int(window)):
            return None
        assert isinstance(bs, int)
        try:
            out.append(KVGroup(kind, bs, window))
        except ValueError:
            return None
    return tuple(out)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def verifier_advert() -> dict[str, Any]:
    """What a chain-verifying reader adds to the dict it hands on with its prefill."""
    return {"v": VERIFY.version, "chain": True}


def advertises_verify(params: Mapping[str, Any] | None) -> bool:
    """Whether ``params`` (a P-node dict) say their reader verifies D's token chain."""
    obj = params.get(VERIFY_KEY) if params else None
    return isinstance(obj, Mapping) and obj.get("v") == VERIFY.version and obj.get("chain") is True


def configured_lease(value: object) -> float | None:
    """D's lease as configured under :data:`LEASE_CONFIG_KEY` (``None``: not set); one
    check for our config parser and for the connector reading vLLM's config."""
    if value is None:
        return None
    if isinstance(value, int | float) and valid_conversation_lease(value):
        return float(value)
    raise ValueError(
        f"kv_connector_extra_config.{LEASE_CONFIG_KEY}: must be a positive "
        f"number of seconds, got {value!r}"
    )


def lease_to_wire(idle_seconds: float) -> dict[str, Any]:
    """The value D adds under :data:`LEASE_KEY`."""
    return {"v": LEASE.version, "idle_seconds": float(idle_seconds)}


def lease_of(params: Mapping[str, Any]) -> float | None:
    """The idle lease D advertised in a params dict; ``None`` when absent, of another
    version or not a positive number (the router then keeps the fixed TTL)."""
    obj = params.get(LEASE_KEY)
    if not isinstance(obj, Mapping) or obj.get("v") != LEASE.version:
        return None
    idle = obj.get("idle_seconds")
    if isinstance(idle, int | float) and valid_conversation_lease(idle):
        return float(idle)
    return None


@dataclass(frozen=True)
class HeldTokens:
    """What the holder of a request's KV holds, in hashes: full-block chain, partial tail,
    count, block size. D's connector puts it in its params; an emulated owner sends it in
    its claim answer; the reader verifies its prompt against it (``policy``)."""

    chain: tuple[bytes, ...]
    tail: bytes
    num_tokens: int
    block_size: int

    @classmethod
    def of(
        cls, tokens: Sequence[int], block_size: int, chain: Sequence[bytes] | None = None
    ) -> HeldTokens:
        """``chain``: ``policy.block_hashes`` of ``tokens`` (or longer) when the caller
        keeps it already; computed otherwise."""
        full = len(tokens) // block_size
        if chain is None:
            chain = block_hashes(tokens, block_size)
        elif len(chain) < full:
            raise ValueError(f"chain covers {len(chain)} blocks, {len(tokens)} tokens need {full}")
        return cls(
            tuple(chain[:full]), tail_hash(tokens[full * block_size :]), len(tokens), block_size
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": TOKEN_CHAIN.version,
            "block_size": self.block_size,
            "num_tokens": self.num_tokens,
            "tail": self.tail.hex(),
            "chain": [h.hex() for h in self.chain],
        }

    @classmethod
    def from_wire(cls, obj: Any) -> HeldTokens:
        """Parse :meth:`to_wire`'s value; ``ValueError`` when it is of another version,
        malformed or inconsistent."""
        if not isinstance(obj, Mapping) or obj.get("v") != TOKEN_CHAIN.version:
            raise ValueError(f"malformed held tokens: not version {TOKEN_CHAIN.version}")
        try:
            held = cls(
                tuple(bytes.fromhex(h) for h in obj["chain"]),
                bytes.fromhex(obj["tail"]),
                int(obj["num_tokens"]),
                int(obj["block_size"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed held tokens: {exc}") from None
        if held.block_size <= 0 or len(held.chain) != held.num_tokens // held.block_size:
            raise ValueError("malformed held tokens: the chain does not cover num_tokens")
        return held

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> HeldTokens | None:
        """D's chain from a params dict; ``None`` when absent, of another version or
        malformed (P then treats D's KV as unverified)."""
        try:
            return cls.from_wire(params.get(CHAIN_KEY))
        except ValueError:
            return None
