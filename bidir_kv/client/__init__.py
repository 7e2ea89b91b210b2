"""Every HTTP conversation bidir_kv has with a node, outside the runtime's own hot path.

Tests, ``bench``, ``doctor``, ``campaign``, ``topology``'s readiness wait and the tools
talk to engines and routers through this package; the router and the engine's
connector keep their own aiohttp sessions (they are the serving path). Built on httpx:
one library gives a blocking and an asyncio client with the same request building,
timeouts and exception tree (docs/architecture.md, "The client").

Reading path:

1. ``errors.py``: :class:`ClientError` and its kinds (transport, HTTP status,
   malformed answer), and ``translated``, the one place httpx's exceptions become ours.
2. ``result.py``: :class:`Completion`, the one result of a completion or chat call
   (streamed or not), and how a body or a stream's chunks fill it.
3. ``sse.py``: the one SSE reader, sync and async, over
   :func:`bidir_kv.protocol.iter_sse_data`.
4. ``node.py``: :class:`NodeClient` / :class:`AsyncNodeClient` (one base), ``Reply``
   for plain requests, ``/metrics`` scraping and one-off ``fetch`` / ``get_json`` /
   ``scrape``.
5. ``deadline.py``: :func:`within`, a wall-clock bound on a whole blocking call
   (httpx's timeouts bound each read, not a server that drips its answer).
6. ``tokens.py``: :class:`TokenClient` (greedy token-id completions of one engine) and
   :func:`run_pd_turn`, one turn through P then D with metric deltas.

The package takes URLs, never topology nodes: it imports only ``protocol``,
``scrape``'s parser and ``errors`` of bidir_kv.
"""

from __future__ import annotations

from bidir_kv.client.deadline import within
from bidir_kv.client.errors import (
    ClientError,
    HTTPStatusError,
    MalformedResponse,
    RequestTimeout,
    TransportError,
)
from bidir_kv.client.node import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    AsyncNodeClient,
    NodeClient,
    Reply,
    fetch,
    get_json,
    read_reply,
    scrape,
)
from bidir_kv.client.result import Completion, StreamCut
from bidir_kv.client.tokens import (
    LegDelta,
    PDTurn,
    TokenClient,
    run_pd_turn,
    settled_metrics,
    token_body,
)

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "AsyncNodeClient",
    "ClientError",
    "Completion",
    "HTTPStatusError",
    "LegDelta",
    "MalformedResponse",
    "NodeClient",
    "PDTurn",
    "Reply",
    "RequestTimeout",
    "StreamCut",
    "TokenClient",
    "TransportError",
    "fetch",
    "get_json",
    "read_reply",
    "run_pd_turn",
    "scrape",
    "settled_metrics",
    "token_body",
    "within",
]
