"""Worker-side KV movement: a registered block pool, one-sided READs, notifications.

Backends: ``nixl`` (UCX over DRAM, when ``nixl`` imports) and ``tcp`` (always
available). :func:`create_agent` picks one; the engine only sees :class:`KVAgent`.
Heavy imports (``nixl``) happen only when a NIXL agent is asked for, so a TCP engine
starts fast.
"""

from __future__ import annotations

import functools
from typing import Literal

from bidir_kv.engine.transport.base import (
    KVAgent,
    KVPool,
    NotificationHandler,
    ReadResult,
    TransportError,
)

__all__ = [
    "BACKENDS",
    "KVAgent",
    "KVPool",
    "NotificationHandler",
    "ReadResult",
    "TransportError",
    "create_agent",
    "nixl_available",
]

Backend = Literal["auto", "nixl", "tcp"]
BACKENDS: tuple[str, ...] = ("auto", "nixl", "tcp")


@functools.cache
def nixl_available() -> tuple[bool, str]:
    """Whether a NIXL agent with the UCX backend can be created here, and why not.

    Cached per process: the probe creates and drops one throwaway agent.
    """
    from bidir_kv.engine.transport.nixl import probe

    return probe()


def create_agent(
    backend: str, name: str, pool: KVPool, *, host: str = "127.0.0.1", port: int = 0
) -> KVAgent:
    """A KV agent for ``backend``: ``nixl``, ``tcp``, or ``auto`` (nixl if it works, else tcp).

    ``host``/``port`` are where the TCP agent listens for data (the NIXL agent talks
    through UCX and ignores them).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown transport {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "nixl" if nixl_available()[0] else "tcp"
    if backend == "nixl":
        ok, why = nixl_available()
        if not ok:
            raise TransportError(f"nixl transport unavailable: {why}")
        from bidir_kv.engine.transport.nixl import NixlAgent

        return NixlAgent(name, pool)
    from bidir_kv.engine.transport.tcp import TcpAgent

    return TcpAgent(name, pool, host=host, port=port)
