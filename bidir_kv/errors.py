"""The one exception tree of bidir_kv.

Every error the package raises on purpose derives from :class:`BidirKVError`; each area
(client, configuration, topology, engine, router, ...) has one subclass of its own below
it, so a caller can catch a whole area or everything of ours in one ``except``.
"""

from __future__ import annotations

__all__ = ["BidirKVError"]


class BidirKVError(Exception):
    """Base of every error bidir_kv raises on purpose."""
