"""Worker-side KV movement: a registered block pool, one-sided READs, notifications.

Reading path: ``base`` (the contract the engine sees: ``KVAgent``, ``KVPool``), then
``wire`` (every name of our engine-to-engine wire; its version is in
``bidir_kv.wire.versions``), ``sidechannel`` (how a reader learns a peer), and one
transport: ``tcp`` (with ``tcp_owner``, ``tcp_io``) or ``nixl``.

Two transports: ``nixl`` (UCX over DRAM, when ``nixl`` imports) and ``tcp`` (always
available). :func:`create_agent` picks one; the engine only sees :class:`KVAgent`.
Heavy imports (``nixl``) happen only when a NIXL agent is asked for, so a TCP engine
starts fast.
"""

from __future__ import annotations

import functools
import logging

from bidir_kv.engine.transport import wire
from bidir_kv.engine.transport.base import (
    KVAgent,
    KVPool,
    KVTransportError,
    NotificationHandler,
    ReadResult,
)

__all__ = [
    "AUTO",
    "TRANSPORT_CHOICES",
    "KVAgent",
    "KVPool",
    "KVTransportError",
    "NotificationHandler",
    "ReadResult",
    "create_agent",
    "nixl_available",
]

logger = logging.getLogger("bidir_kv.engine.transport")

AUTO = "auto"  # NIXL if an agent can be created here, else TCP
TRANSPORT_CHOICES: tuple[str, ...] = (AUTO, wire.NIXL, wire.TCP)


@functools.cache
def nixl_available() -> tuple[bool, str]:
    """Whether a NIXL agent with the UCX backend can be created here, and why not.

    Cached per process: the probe creates and drops one throwaway agent.
    """
    from bidir_kv.engine.transport.nixl import probe

    return probe()


def create_agent(
    transport: str, name: str, pool: KVPool, *, host: str = "127.0.0.1", port: int = 0
) -> KVAgent:
    """A KV agent for ``transport``: ``nixl``, ``tcp``, or ``auto`` (nixl if it works, else tcp).

    For ``nixl``/``auto`` the NIXL agent (and its UCX backend) is created right here,
    so ``auto`` falls back to TCP, with a logged reason, when it cannot be.

    ``host``/``port`` are where the TCP agent listens for data (the NIXL agent talks
    through UCX and ignores them).
    """
    if transport not in TRANSPORT_CHOICES:
        raise ValueError(
            f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORT_CHOICES)}"
        )
    if transport in (AUTO, wire.NIXL):
        try:
            from bidir_kv.engine.transport.nixl import NixlAgent

            return NixlAgent(name, pool)
        except KVTransportError as exc:
            if transport == wire.NIXL:
                raise
            logger.warning("NIXL transport unavailable (%s); using TCP", exc)
    from bidir_kv.engine.transport.tcp import TcpAgent

    return TcpAgent(name, pool, host=host, port=port)
