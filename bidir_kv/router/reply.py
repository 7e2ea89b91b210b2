"""The assistant message as the client will send it back, from what the relay passed on.

History identity (:mod:`bidir_kv.router.history`) keys a turn's entry by its messages
followed by this reply. The relay only keeps D's data payloads while it streams them
(one list append per event, docs/architecture.md invariant 8); they are decoded here,
once, after the stream, in one C call.
"""

from __future__ import annotations

import contextlib
from typing import Any

import orjson

__all__ = ["assemble_reply"]


def _events(chunks: list[bytes]) -> list[Any]:
    """Every payload decoded, in one call when all are JSON (the usual case)."""
    try:
        events: list[Any] = orjson.loads(b"[" + b",".join(chunks) + b"]")
        return events
    except orjson.JSONDecodeError:
        out = []
        for chunk in chunks:
            with contextlib.suppress(orjson.JSONDecodeError):
                out.append(orjson.loads(chunk))
        return out


def assemble_reply(chunks: list[bytes]) -> dict[str, Any] | None:
    """Choice 0's message from a stream's payloads: content deltas joined, tool calls
    merged by their ``index`` (arguments joined), reasoning left out."""
    content: list[str] = []
    seen_content = False
    calls: dict[int, dict[str, Any]] = {}
    for event in _events(chunks):
        choices = event.get("choices") if isinstance(event, dict) else None
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            text = delta.get("content")
            if isinstance(text, str):
                seen_content = True
                content.append(text)
            for tc in delta.get("tool_calls") or ():
                if not isinstance(tc, dict) or not isinstance(tc.get("index", 0), int):
                    return None
                slot = calls.setdefault(tc.get("index", 0), {"function": {"arguments": ""}})
                for key in ("id", "type"):
                    if tc.get(key) is not None:
                        slot[key] = tc[key]
                fn = tc.get("function") or {}
                if not isinstance(fn, dict):
                    return None
                if fn.get("name") is not None:
                    slot["function"]["name"] = fn["name"]
                if isinstance(fn.get("arguments"), str):
                    slot["function"]["arguments"] += fn["arguments"]
    return {
        "role": "assistant",
        "content": "".join(content) if seen_content else None,
        "tool_calls": [calls[i] for i in sorted(calls)] or None,
    }
