"""The engine's JSON encoding: compact UTF-8, as vLLM's OpenAI server writes its bodies.

Why not ``json.dumps``: at a long prompt P answers the router's ``/tokenize`` and its
``max_tokens=1`` prefill with every prompt token id in the body; ``json.dumps`` of
24k ids is milliseconds of the emulator's own CPU per request, which competes with
the prefill time it emulates (docs/benchmarking.md "Overhead and load"). orjson
writes the same JSON values an order of magnitude faster. What orjson refuses and
the standard library accepts (integers beyond 64 bits, lone surrogates) falls back
to ``json.dumps``. A non-finite float, which JSON cannot hold (vLLM refuses to write
one), comes out as ``null`` (docs/engine.md).
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from aiohttp import web

__all__ = ["dumps", "json_response"]

_JSON = "application/json"


def dumps(obj: Any) -> bytes:
    """``obj`` as compact JSON in UTF-8 (the standard library's values, faster)."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    except (orjson.JSONEncodeError, TypeError):
        return json.dumps(obj, separators=(",", ":")).encode()


def json_response(obj: Any, status: int = 200) -> web.Response:
    """``web.json_response`` with :func:`dumps`: same status and Content-Type."""
    return web.Response(body=dumps(obj), status=status, content_type=_JSON, charset="utf-8")
