"""Reading a JSON request body defensively: every bad input is a 4xx naming the problem.

Why: aiohttp's ``request.json()`` lets hostile bodies through as 500s — an unknown
``charset`` in Content-Type (``LookupError``), nesting deeper than the parser's
recursion limit (``RecursionError``), ``\\ud800`` escapes that decode to lone
surrogates and fail later when the text is encoded. vLLM (pydantic) answers such
bodies with 4xx; so does the emulator.
"""

from __future__ import annotations

import codecs
import json
from typing import Any

from aiohttp import web

__all__ = ["MAX_DEPTH", "BodyError", "read_json_body"]

MAX_DEPTH = 64  # nesting levels of objects/arrays a request may use


class BodyError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _charset(request: web.Request) -> str:
    charset = request.charset or "utf-8"
    try:
        name = codecs.lookup(charset).name
    except LookupError:
        raise BodyError(415, f"unsupported charset {charset!r} in Content-Type") from None
    if name not in ("utf-8", "utf-16", "utf-32", "ascii", "latin-1", "iso8859-1"):
        raise BodyError(415, f"unsupported charset {charset!r} in Content-Type (use utf-8)")
    return name


def _check(value: Any, depth: int) -> None:
    """Raise on nesting deeper than :data:`MAX_DEPTH` or on a lone surrogate."""
    if depth > MAX_DEPTH:
        raise BodyError(400, f"request JSON is nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BodyError(
                400, "request JSON holds an invalid code point (a lone UTF-16 surrogate)"
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check(k, depth + 1)
            _check(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check(v, depth + 1)


async def read_json_body(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; raises :class:`BodyError` (4xx) otherwise."""
    charset = _charset(request)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise BodyError(413, f"request body too large: {exc.text}") from None
    try:
        text = raw.decode(charset)
    except UnicodeDecodeError as exc:
        raise BodyError(400, f"request body is not valid {charset}: {exc.reason}") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise BodyError(400, f"request JSON is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise BodyError(400, f"request body is not valid JSON: {exc}") from None
    try:
        _check(body, 0)
    except RecursionError:
        raise BodyError(400, f"request JSON is nested deeper than {MAX_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise BodyError(400, "request body must be a JSON object")
    return body
