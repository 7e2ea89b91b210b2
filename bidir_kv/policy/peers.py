"""Which peers a node may read KV from: the peer allowlist (docs/connector.md §7).

vLLM connects to whatever ``remote_host``/``remote_port`` a request's
``kv_transfer_params`` name, so anyone who can reach a node can make it open
connections anywhere. With ``bidir_kv_peer_allowlist`` set (engine ids and/or host
networks), params naming a peer outside it are refused before any connection: the
node computes the prompt itself. Unset keeps vLLM's behaviour.

:func:`peer_entries` is the one rule for what a deployment we start writes there
(``bidir-kv serve``, the topologies): each peer it knows, by its address when it has one.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["PeerAllowlist", "peer_entries"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class PeerAllowlist:
    """Engine ids and networks a node reads from; a peer matching either is allowed."""

    engine_ids: frozenset[str]
    networks: tuple[Network, ...]

    @classmethod
    def parse(cls, value: object) -> PeerAllowlist | None:
        """From the config value: ``None`` (unset), or a list of strings, each an IP
        network (``10.0.0.0/8``, ``127.0.0.1``) or else an engine id. ``ValueError``
        for anything else (a security setting is not silently dropped)."""
        if value is None:
            return None
        if isinstance(value, str) or not isinstance(value, Sequence) or not value:
            raise ValueError(
                f"must be a non-empty list of engine ids and/or host networks, got {value!r}"
            )
        ids: set[str] = set()
        nets: list[Network] = []
        for item in value:
            if not isinstance(item, str) or not item.strip():
                raise ValueError(f"entries must be non-empty strings, got {item!r}")
            try:
                nets.append(ipaddress.ip_network(item.strip(), strict=False))
            except ValueError:
                ids.add(item.strip())
        return cls(frozenset(ids), tuple(nets))

    def allows(self, engine_id: str | None, host: str | None) -> bool:
        """Whether params naming ``engine_id`` at ``host`` may be read from. A host
        name (not an address) matches no network: it is never resolved here."""
        if engine_id is not None and engine_id in self.engine_ids:
            return True
        if host is None:
            return False
        try:
            addr = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return False
        return any(addr in net for net in self.networks)

    def describe(self) -> str:
        parts = sorted(self.engine_ids) + [str(n) for n in self.networks]
        return ", ".join(parts)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def peer_entries(peers: Iterable[tuple[str | None, str | None]]) -> tuple[str, ...]:
    """The allowlist entries for the peers a deployment knows, each ``(engine_id, host)``:
    a peer whose host is an IP address is listed by that address, any other by its
    engine id. Never both: a peer matching either entry is allowed, and params come from
    the client, so an engine id listed beside its address would admit that id at any
    host (anyone can copy a real D's dict and change ``remote_host``). A host that is a
    name matches no entry (names are never resolved), hence the engine id for it.
    Order kept, repeats dropped, a peer with neither skipped; ``()`` when none is known."""
    out: list[str] = []
    for engine_id, host in peers:
        entry = host.strip("[]") if host and _is_address(host) else engine_id
        if entry and entry not in out:
            out.append(entry)
    return tuple(out)
