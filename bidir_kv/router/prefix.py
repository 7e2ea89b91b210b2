"""Longest-prefix lookup of retained turns for requests that carry no id.

A chat client that rewrites the last reply (a recorded answer, a reasoning trace the
template drops, a cut tool output) sends a history whose digest matches no stored turn,
yet everything before the rewritten message is exactly what D retains. So a stored turn
is indexed under the history digests at its message boundaries, and a request probes
the digests of its own boundaries, longest first: the first stored turn found is the
one sharing the most messages with it (docs/router.md "Longest prefix").

Which boundaries: a history of messages ``m[0..n)`` has a boundary ``j`` after each
prefix ``m[0..j)``. Only prefixes that reach at least the first assistant message's
position count (``j >= first``): shorter ones are a first turn's prompt, which other
conversations of the tenant may share (a common system prompt), and a turn found
through one would be taken from the conversation it belongs to. Of those, the
:data:`RECENT` last boundaries and ``first + 2**i`` are used: a conversation of ``n``
messages costs ``RECENT + log2(n)`` keys at most, and a stored turn and a later request
share every power-of-two offset however far apart their ends are (a message rewritten
long ago still finds a prefix at least half as long as the common one).

The digests are :mod:`bidir_kv.router.history`'s running SHA-256 of scope and
canonical messages, so a boundary key names the tenant, the prompt-changing fields and
every message up to it: a probe can only find turns of the same tenant, model and
``cache_salt``. What a found turn really shares with the request is then decided in
tokens by the continuation guard (or by a prefill node that checks D's chain).
"""

from __future__ import annotations

from typing import Final

__all__ = ["RECENT", "boundaries"]

RECENT: Final = 8  # the last boundaries of a history, always indexed and probed


def boundaries(first: int, end: int) -> list[int]:
    """Message counts ``j`` in ``[first, end]`` at which a history is indexed (a stored
    turn: ``end`` = its messages and the reply) or probed (a request: ``end`` = its
    messages), longest first; empty when ``end < first``."""
    if end < first:
        return []
    picked = set(range(max(first, end - RECENT + 1), end + 1))
    step = 1
    picked.add(first)
    while first + step <= end:
        picked.add(first + step)
        step *= 2
    return sorted(picked, reverse=True)
