"""A client's request body, read and checked before any engine sees it.

Everything here answers a clear 4xx (:class:`Rejected`) instead of letting an
odd body reach an engine or crash the router: an oversize body (413, decided
from ``Content-Length`` before reading, and the read itself capped), a charset
other than UTF-8 (415), JSON that does not parse, nests too deeply or carries
lone surrogates (400), and the fields the P leg does not send P (``stream``,
``max_tokens``, ``max_completion_tokens``, ``min_tokens``, ``stream_options``,
``n``), which D would refuse only after P had prefilled and leased the prompt.
Every other field reaches P unchanged, so P refuses what D would.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from aiohttp import web

__all__ = ["MAX_JSON_DEPTH", "Rejected", "check_fields", "parse_body", "read_body"]

MAX_JSON_DEPTH: Final = 64
_UTF8: Final = ("utf-8", "utf8")
_BOOL_FIELDS: Final = ("stream", "ignore_eos", "return_token_ids")


class Rejected(Exception):
    """A request the router answers itself; ``message`` names the problem."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def kind(self) -> str:
        return {413: "RequestEntityTooLarge", 415: "UnsupportedMediaType"}.get(
            self.status, "BadRequestError")


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    """The body, at most ``max_bytes``: refused up front by ``Content-Length``, and the
    read stops at the cap (a chunked body without a length is never read to its end)."""
    charset = request.charset
    if charset is not None and charset.lower() not in _UTF8:
        raise Rejected(415, f"unsupported charset {charset!r} in Content-Type: JSON request "
                       "bodies must be UTF-8")
    length = request.content_length
    if length is not None and length > max_bytes:
        raise Rejected(413, f"request body of {length} bytes exceeds the limit of {max_bytes} "
                       "bytes (--max-body-bytes)")
    buf = bytearray()
    while True:
        chunk = await request.content.readany()
        if not chunk:
            return bytes(buf)
        buf += chunk
        if len(buf) > max_bytes:
            raise Rejected(413, f"request body exceeds the limit of {max_bytes} bytes "
                           "(--max-body-bytes)")


def parse_body(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object; refuse deep nesting and invalid code points by name."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise Rejected(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except UnicodeDecodeError as exc:
        raise Rejected(400, f"request body is not valid UTF-8: {exc.reason} at byte "
                       f"{exc.start}") from None
    except ValueError as exc:
        raise Rejected(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise Rejected(400, "request body must be a JSON object")
    _check_tree(body, check_strings=b"\\u" in raw)
    return body


def _check_tree(root: Any, check_strings: bool) -> None:
    """Depth and, when escapes could hide one, lone surrogates (iterative walk)."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise Rejected(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, dict):
            for key, value in node.items():
                if check_strings:
                    _check_string(key)
                stack.append((value, depth + 1))
        elif isinstance(node, list):
            stack.extend((value, depth + 1) for value in node)
        elif check_strings and isinstance(node, str):
            _check_string(node)


def _check_string(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise Rejected(400, f"request body has an invalid code point U+{code:04X} (a lone "
                       "surrogate) in a string") from None


def _int_field(body: Mapping[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise Rejected(400, f"'{key}' must be an integer >= {minimum}, got {value!r}", key)
    return value


def check_fields(body: Mapping[str, Any], endpoint: str) -> None:
    """Refuse, naming the field, what D would refuse but the P leg never sends P."""
    for key in _BOOL_FIELDS:
        value = body.get(key)
        if value is not None and not isinstance(value, bool):
            raise Rejected(400, f"'{key}' must be a boolean, got {value!r}", key)
    n = body.get("n")
    if n is not None and (n != 1 or isinstance(n, bool)):
        raise Rejected(400, f"'n' must be 1 through the P/D router, got {n!r}", "n")
    max_tokens = _int_field(body, "max_tokens", 1)
    if endpoint == "chat/completions":
        max_tokens = _int_field(body, "max_completion_tokens", 1) or max_tokens
    min_tokens = _int_field(body, "min_tokens", 0)
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise Rejected(400, f"'min_tokens' ({min_tokens}) must not exceed max_tokens "
                       f"({max_tokens})", "min_tokens")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, Mapping):
        raise Rejected(400, f"'stream_options' must be an object, got {opts!r}",
                       "stream_options")
    if endpoint == "chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise Rejected(400, "'messages' must be a list of message objects", "messages")
    elif "prompt" not in body:
        raise Rejected(400, "'prompt' is required", "prompt")
