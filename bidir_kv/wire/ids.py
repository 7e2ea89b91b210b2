"""Type aliases for the identifiers that cross the wire.

They are plain aliases, not new types: a ``RequestId`` is the ``str`` vLLM sends, so
nothing converts at a boundary. They say in a signature which string or which list of
lists is meant, where ``str`` and ``list[list[int]]`` say nothing.
"""

from __future__ import annotations

from typing import TypeAlias

__all__ = ["BlockIds", "EngineId", "RequestId"]

RequestId: TypeAlias = str
"""A request's id as the engine knows it (vLLM's ``request_id``; ``remote_request_id``
in a peer's params)."""

EngineId: TypeAlias = str
"""An engine instance's id (vLLM's ``engine_id``; ``remote_engine_id`` in params)."""

BlockIds: TypeAlias = list[list[int]]
"""KV block ids, one list per KV-cache group (``remote_block_ids``)."""
