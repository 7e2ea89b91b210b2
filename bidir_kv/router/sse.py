"""Byte-level helpers for the streaming hot path.

The relay decodes JSON only for the terminal chunk (an invariant in
docs/architecture.md: per-chunk decoding would dominate the router's own
latency), so these functions work on the raw ``data:`` payload with
``bytes.find``. Inside a JSON string every ``"`` is escaped, so an unescaped
``"key":`` can only be an object key; that is what makes the byte tests exact
for valid JSON.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "UNTRACKED_DELTA_KEYS",
    "event_end",
    "strip_null_params",
    "take_int_list",
    "untracked_delta",
]

# Deltas a client may drop or re-render when it sends the history back
# (vLLM issue #43094, PR #44838).
UNTRACKED_DELTA_KEYS: Final = ("reasoning", "reasoning_content", "tool_calls", "function_call")
_KEYS: Final = tuple((name, f'"{name}"'.encode()) for name in UNTRACKED_DELTA_KEYS)
_WS: Final = b" \t\r\n"
_NULL_PARAMS: Final = (b',"kv_transfer_params":null', b', "kv_transfer_params": null')
_PARAMS_KEY: Final = b'"kv_transfer_params"'


def _value_start(data: bytes, key_end: int) -> int:
    """Index of the value after ``"key"`` ending at ``key_end``, or -1 if not a key."""
    n = len(data)
    j = key_end
    while j < n and data[j] in _WS:
        j += 1
    if j >= n or data[j] != ord(":"):
        return -1
    j += 1
    while j < n and data[j] in _WS:
        j += 1
    return j if j < n else -1


def untracked_delta(data: bytes) -> str | None:
    """Name of the first reasoning/tool key with a non-empty value, else ``None``."""
    for name, key in _KEYS:
        start = 0
        while (i := data.find(key, start)) >= 0:
            start = i + len(key)
            j = _value_start(data, start)
            if j < 0:
                continue
            rest = data[j : j + 4]
            if rest.startswith(b"null") or rest.startswith(b'""'):
                continue
            if rest.startswith(b"["):
                k = j + 1
                while k < len(data) and data[k] in _WS:
                    k += 1
                if k < len(data) and data[k] == ord("]"):
                    continue
            return name
    return None


def take_int_list(data: bytes, key: bytes, remove: bool) -> tuple[list[int] | None, bytes]:
    """Find ``"key": [ints]``; return the ints and (if ``remove``) ``data`` without the member.

    ``key`` is the bare name (``b"token_ids"``). A ``null`` value yields ``None``
    and is removed too. Only the first occurrence is handled (``n == 1`` streams).
    """
    compact = b',"' + key + b'":['
    i = data.find(compact)
    if i >= 0:  # fast path: vLLM's compact JSON, member not first in its object
        k = data.find(b"]", i)
        if k > 0:
            try:
                inner = data[i + len(compact) : k]
                ids = [int(x) for x in inner.split(b",")] if inner.strip() else []
            except ValueError:
                return None, data
            return ids, (data[:i] + data[k + 1 :]) if remove else data
    needle = b'"' + key + b'"'
    start = 0
    while (i := data.find(needle, start)) >= 0:
        start = i + len(needle)
        j = _value_start(data, start)
        if j < 0:
            continue
        if data.startswith(b"null", j):
            ints = None
            end = j + 4
        elif data[j] == ord("["):
            k = data.find(b"]", j)
            if k < 0:
                return None, data
            inner = data[j + 1 : k].strip()
            try:
                ints = [int(x) for x in inner.split(b",")] if inner else []
            except ValueError:
                return None, data
            end = k + 1
        else:
            return None, data
        if not remove:
            return ints, data
        return ints, _cut_member(data, i, end)
    return None, data


def _cut_member(data: bytes, key_start: int, value_end: int) -> bytes:
    """Remove the object member spanning ``[key_start, value_end)`` and one comma."""
    b = key_start - 1
    while b >= 0 and data[b] in _WS:
        b -= 1
    if b >= 0 and data[b] == ord(","):
        return data[:b] + data[value_end:]
    e = value_end
    while e < len(data) and data[e] in _WS:
        e += 1
    if e < len(data) and data[e] == ord(","):
        e += 1
    return data[:key_start] + data[e:]


def strip_null_params(data: bytes) -> bytes | None:
    """``data`` without ``"kv_transfer_params": null``; ``None`` if the key stays (decode it)."""
    for form in _NULL_PARAMS:
        if form in data:
            data = data.replace(form, b"")
    if _PARAMS_KEY not in data:
        return data
    i = data.find(_PARAMS_KEY)
    j = _value_start(data, i + len(_PARAMS_KEY))
    if j >= 0 and data.startswith(b"null", j):
        return _cut_member(data, i, j + 4)
    return None


def event_end(buf: bytes | bytearray, start: int = 0) -> tuple[int, int]:
    """(index, separator length) of the first SSE event boundary, or (-1, 0)."""
    a = buf.find(b"\n\n", start)
    b = buf.find(b"\r\n\r\n", start)
    if b >= 0 and (a < 0 or b < a):
        return b, 4
    if a >= 0:
        return a, 2
    return -1, 0
