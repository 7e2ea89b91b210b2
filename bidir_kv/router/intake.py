"""A client's request body, read and checked before any engine sees it.

The checks are :mod:`bidir_kv.intake`'s, the same the engine applies, so the router
refuses (4xx, naming the problem) exactly what D would refuse — before the P leg,
which is sent ``stream: false``, ``max_tokens: 1`` and none of the output options
and would otherwise prefill and lease a prompt D then refuses. The router adds one
rule of its own: a P/D turn produces one choice.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from bidir_kv.intake import InputError, check_request, decode_json, read_capped

__all__ = ["InputError", "read_request"]


async def read_request(request: web.Request, max_bytes: int, endpoint: str) -> dict[str, Any]:
    """The checked body of a client's request; raises :class:`InputError` (4xx)."""
    body = decode_json(await read_capped(request, max_bytes, "--max-body-bytes"))
    check_request(body, chat=endpoint == "chat/completions")
    n = body.get("n")
    if n is not None and n != 1:
        raise InputError(400, f"'n' must be 1 through the P/D router, got {n!r}", "n")
    return body
