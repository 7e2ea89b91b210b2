"""Worker-side KV movement: a registered block pool, one-sided READs, notifications.

Backends: ``nixl`` (UCX over DRAM, when ``nixl`` imports) and ``tcp`` (always
available). :func:`create_agent` picks one; the engine only sees :class:`KVAgent`.
"""

from bidir_kv.engine.transport.base import (
    KVAgent,
    KVPool,
    NotificationHandler,
    ReadResult,
    TransportError,
)

__all__ = ["KVAgent", "KVPool", "NotificationHandler", "ReadResult", "TransportError"]
