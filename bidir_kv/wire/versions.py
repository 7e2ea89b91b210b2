"""Every wire we define, with its version and the history of incompatible changes.

One registry, so a reviewer sees in one place what an incompatible change must touch.
A wire's version is the number of lines in its history: an incompatible change adds a
line saying what changed, and the version follows. Compatible additions (a new key a
reader may ignore) add no line. The module named in ``where`` builds and parses the
wire; both ends read the version from here. vLLM's own fields and its NIXL connector
version (docs/protocol.md §3.6) are vLLM's and are not listed.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "FENCE",
    "GROUPS",
    "LEASE",
    "NOTIFICATIONS",
    "TOKEN_CHAIN",
    "TRANSPORT",
    "VERIFY",
    "WIRES",
    "Wire",
]


@dataclass(frozen=True)
class Wire:
    """One wire: its name, the module that builds and parses it, its history."""

    name: str
    where: str
    history: tuple[str, ...]  # line i describes version i + 1

    @property
    def version(self) -> int:
        return len(self.history)


TRANSPORT = Wire(
    "transport",
    "bidir_kv.engine.transport.wire",
    (
        "msgpack frames on the side channel and the TCP data port, agent metadata with "
        "transport and v; the version is the connector version in the compatibility hash",
        "the claim answer's tokens are the token-chain value (v and block_size added), "
        "so an engine of version 1 is refused at the handshake",
    ),
)

NOTIFICATIONS = Wire(
    "notifications",
    "bidir_kv.engine.notifications",
    (
        "vLLM 0.33's transport notifications: completion '<request_id>:<n>', "
        "heartbeat 'HB:<id>,<id>,...'",
    ),
)

TOKEN_CHAIN = Wire(
    "token chain",
    "bidir_kv.wire.params",
    (
        "D's held tokens under bidir_kv_chain (and in an engine's claim answer): "
        "{v, block_size, num_tokens, tail, chain}, hashes as hex of policy.block_hashes "
        "and policy.tail_hash",
    ),
)

LEASE = Wire(
    "lease",
    "bidir_kv.wire.params",
    ("D's renewable lease under bidir_kv_lease: {v, idle_seconds}",),
)

FENCE = Wire(
    "fence",
    "bidir_kv.wire.fence",
    (
        "a reader's advert under bidir_kv_fence {v, reads} in the dict it hands on with "
        "its prefill; D's generation word {v, slot, gen[, base]} with a retained turn",
    ),
)

VERIFY = Wire(
    "verify",
    "bidir_kv.wire.params",
    (
        "a reader's advert under bidir_kv_verify {v, chain} in the dict it hands on with "
        "its prefill: it reads only the prefix D's token chain proves",
    ),
)

GROUPS = Wire(
    "kv cache groups",
    "bidir_kv.wire.params",
    (
        "D's KV cache groups under bidir_kv_groups {v, groups: [{kind, block_size[, window]}]}, "
        "in the order of its remote_block_ids lists",
    ),
)

WIRES: tuple[Wire, ...] = (TRANSPORT, NOTIFICATIONS, TOKEN_CHAIN, LEASE, FENCE, VERIFY, GROUPS)
