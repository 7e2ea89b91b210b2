"""A JSON request body: read with a cap, decoded, and refused with a 4xx when hostile.

Why: a plain ``json.loads`` lets hostile bodies through as 500s or as trouble later —
an unknown ``charset`` in Content-Type (``LookupError``), nesting deeper than the
parser's recursion limit (``RecursionError``), ``"\\ud800"`` escapes that decode to lone
surrogates and fail when the text is encoded, and bodies read to their end before
their size is judged.

Charset policy (one answer for router and engine): JSON text is Unicode (RFC 8259,
section 8.1). A declared charset must be UTF-8, UTF-16, UTF-32 or US-ASCII, else 415 naming
it; the bytes are decoded by JSON's own encoding detection, as vLLM's FastAPI server
does (it ignores the charset parameter).
"""

from __future__ import annotations

import codecs
import json
from typing import Any, Final

from aiohttp import web

from bidir_kv.intake.errors import InputError

__all__ = ["MAX_JSON_DEPTH", "check_charset", "decode_json", "read_capped"]

MAX_JSON_DEPTH: Final = 64  # nesting levels of objects/arrays a request may use
_UNICODE_CODECS: Final = frozenset(
    {
        "utf-8",
        "utf-8-sig",
        "utf-16",
        "utf-16-le",
        "utf-16-be",
        "utf-32",
        "utf-32-le",
        "utf-32-be",
        "ascii",
    }
)


def check_charset(charset: str | None) -> None:
    """Refuse (415) a declared charset JSON cannot be written in, or an unknown one."""
    if charset is None:
        return
    try:
        name = codecs.lookup(charset).name
    except LookupError:
        name = None
    if name not in _UNICODE_CODECS:
        raise InputError(
            415,
            f"unsupported charset {charset!r} in Content-Type: JSON request bodies must be UTF-8",
        )


async def read_capped(request: web.Request, max_bytes: int, limit_name: str) -> bytes:
    """The body, at most ``max_bytes``: refused up front by ``Content-Length``, and the
    read stops at the cap (a chunked body without a length is never read to its end).
    ``limit_name`` names the setting in the 413's message."""
    check_charset(request.charset)
    length = request.content_length
    if length is not None and length > max_bytes:
        raise InputError(
            413,
            f"request body of {length} bytes exceeds the limit of {max_bytes} bytes ({limit_name})",
        )
    buf = bytearray()
    while True:
        chunk = await request.content.readany()
        if not chunk:
            return bytes(buf)
        buf += chunk
        if len(buf) > max_bytes:
            raise InputError(
                413, f"request body exceeds the limit of {max_bytes} bytes ({limit_name})"
            )


def decode_json(raw: bytes) -> dict[str, Any]:
    """A JSON object from ``raw``; refuse deep nesting and invalid code points by name."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except UnicodeDecodeError as exc:
        raise InputError(
            400, f"request body is not valid {_encoding(raw)}: {exc.reason} at byte {exc.start}"
        ) from None
    except ValueError as exc:
        raise InputError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InputError(400, "request body must be a JSON object")
    # UTF-8 bytes cannot hold a surrogate: only a \u escape can make one (UTF-16/32
    # bodies decode with surrogatepass, so they are always checked).
    _check_tree(body, check_strings=b"\\u" in raw or _encoding(raw) != "UTF-8")
    return body


def _encoding(raw: bytes) -> str:
    return json.detect_encoding(raw).upper().replace("UTF-8-SIG", "UTF-8")


def _too_deep() -> InputError:
    return InputError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels")


_NUMBERS = frozenset({int, float, bool, type(None)})  # leaves never checked
_SCALARS = _NUMBERS | {str}  # leaves when strings need no check


def _check_tree(root: Any, check_strings: bool) -> None:
    """Depth and, when needed, lone surrogates; iterative, so no depth can recurse."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        if isinstance(node, dict):
            for key, value in node.items():
                if check_strings:
                    _check_string(key)
                stack.append((value, depth + 1))
        elif isinstance(node, list):
            if node and depth >= MAX_JSON_DEPTH:
                raise _too_deep()  # as its first child would
            if set(map(type, node)) <= (_NUMBERS if check_strings else _SCALARS):
                continue  # a long list of ids: leaves with nothing to check, one C pass
            stack.extend((value, depth + 1) for value in node)
        elif check_strings and isinstance(node, str):
            _check_string(node)


def _check_string(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise InputError(
            400,
            f"request body has an invalid code point U+{code:04X} (a lone surrogate) in a string",
        ) from None
