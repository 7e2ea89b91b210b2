"""A conversation recognised by its history: the digest that keys reuse without an id.

A chat client resends the whole history each turn, so the next request's messages
begin with this request's messages followed by the assistant's reply. The router saw
both, so it stores D's params under the digest of (scope, messages + reply) and a
later request finds them under the digest of (scope, its messages up to and including
the last assistant message). docs/router.md "Identity" gives the rules and why a
forged history cannot reach another tenant's entry.

The canonical form of a message keeps what a chat template renders: the role, the
content (a string, or the list of parts as sent), tool calls (id, type, function name
and arguments; a streamed call's ``index`` is dropped) and any other field the client
set. Reasoning fields are left out (templates strip them, and a client need not send
them back); ``None`` and empty lists count as absent. The scope is the tenant plus
every request field that changes the prompt's tokens (:data:`SCOPE_FIELDS`): two
requests that differ in one of them never share an entry.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from bidir_kv.router.identity import ConversationKey, IdentityError
from bidir_kv.router.prefix import boundaries

__all__ = [
    "HISTORY_SOURCE",
    "REASONING_FIELDS",
    "SCOPE_FIELDS",
    "History",
    "canonical_message",
    "history_of",
    "opt_out",
    "scope_bytes",
]

HISTORY_SOURCE: Final = "history"  # ConversationKey.source of a history digest
_VERSION: Final = b"bidir-kv history 1\n"  # a change of the canonical form changes this

# Request fields that change the tokens a template renders from the same messages.
SCOPE_FIELDS: Final = (
    "model",
    "cache_salt",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "reasoning_effort",
    "include_reasoning",
    "thinking_token_budget",
    "mm_processor_kwargs",
    "media_io_kwargs",
)
# Fields a template drops from an assistant message (and clients often do not send back).
REASONING_FIELDS: Final = frozenset({"reasoning", "reasoning_content"})


def _dumps(value: Any) -> bytes:
    """Canonical JSON: sorted keys, compact, UTF-8 (stdlib for what orjson refuses)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, TypeError):
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
            "utf-8", "surrogateescape"
        )


def _absent(value: Any) -> bool:
    return value is None or (isinstance(value, list | dict) and not value)


def _content(value: Any, where: str) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict):
                raise IdentityError(f"{where}[{j}] must be a content-part object")
            parts.append({k: v for k, v in part.items() if v is not None})
        return parts
    raise IdentityError(f"{where} must be a string, a list of content parts or null")


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise IdentityError(f"{where} must be a list of tool calls")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise IdentityError(f"{at} must be an object")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise IdentityError(f"{at}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str):
            raise IdentityError(f"{at}.function.name must be a string")
        args = fn.get("arguments")
        if args is not None and not isinstance(args, str | dict):
            raise IdentityError(f"{at}.function.arguments must be a string or an object")
        for key in ("id", "type"):
            if call.get(key) is not None and not isinstance(call[key], str):
                raise IdentityError(f"{at}.{key} must be a string")
        canon: dict[str, Any] = {"function": {"name": name, "arguments": args}}
        canon.update({k: call[k] for k in ("id", "type") if call.get(k) is not None})
        calls.append(canon)
    return calls


def canonical_message(message: Any, where: str = "message") -> dict[str, Any]:
    """The part of one message a template renders; :class:`IdentityError` (naming the
    field, e.g. ``messages[2].role``) for a message the router cannot read."""
    if not isinstance(message, dict):
        raise IdentityError(f"{where} must be an object")
    role = message.get("role")
    if not isinstance(role, str):
        raise IdentityError(f"{where}.role must be a string")
    out: dict[str, Any] = {}
    for key, value in message.items():
        if key in REASONING_FIELDS or _absent(value):
            continue
        if key == "content":
            out[key] = _content(value, f"{where}.content")
        elif key == "tool_calls":
            out[key] = _tool_calls(value, f"{where}.tool_calls")
        else:
            out[key] = value
    return out


def opt_out(body: Mapping[str, Any], chat: bool) -> str | None:
    """Why a request takes the ordinary P->D path with no history key (``None``: it
    does not). Only a one-choice chat turn with its whole prompt is recognisable."""
    if not chat:
        return "completions"
    if body.get("n") not in (None, 1):
        return "n"
    if body.get("truncate_prompt_tokens") is not None:
        return "truncate_prompt_tokens"
    return None


@dataclass(frozen=True)
class History:
    """One request's history digests. ``lookup`` keys the entry of an exact continuation
    (the turn whose messages and reply this request repeats; ``None``: no assistant
    message yet); ``probes`` are the keys of every boundary a stored turn may be found
    under, longest first, ``lookup`` among them (:mod:`bidir_kv.router.prefix`);
    :meth:`index_after` names the entry this turn leaves and the keys it is found by."""

    tenant: str
    lookup: ConversationKey | None
    probes: tuple[ConversationKey, ...]
    _state: Any  # sha256 after the scope and every message of the request
    _marks: tuple[ConversationKey, ...]  # the entry's boundaries up to this request's end

    def key_after(self, reply: Mapping[str, Any]) -> ConversationKey:
        """The key of this request's messages followed by ``reply`` (the assistant
        message the client will send back)."""
        h = self._state.copy()
        h.update(_dumps(canonical_message(dict(reply), "reply")) + b"\n")
        return _key(self.tenant, h.hexdigest())

    def index_after(
        self, reply: Mapping[str, Any]
    ) -> tuple[ConversationKey, tuple[ConversationKey, ...]]:
        """(the entry's key, the keys it is indexed under, longest first): the entry is
        found by an exact continuation and by a request sharing a prefix with it."""
        key = self.key_after(reply)
        return key, (key, *self._marks)


def _key(tenant: str, digest: str) -> ConversationKey:
    return ConversationKey(tenant=tenant, conversation_id=digest, source=HISTORY_SOURCE)


def scope_bytes(body: Mapping[str, Any], tenant: str) -> bytes:
    """The digest's scope: the tenant and every prompt-changing field as sent."""
    fields = {k: body[k] for k in SCOPE_FIELDS if k in body}
    return _dumps({"tenant": tenant, "fields": fields})


def history_of(body: Mapping[str, Any], tenant: str) -> History:
    """Digest a chat request's messages (checked by :func:`canonical_message`) at the
    boundaries it probes and the ones its entry will be indexed under."""
    messages: Sequence[Any] = body.get("messages") or ()
    lines = []
    assistant = []
    for i, message in enumerate(messages):
        canon = canonical_message(message, f"messages[{i}]")
        lines.append(_dumps(canon) + b"\n")
        if canon["role"] == "assistant":
            assistant.append(i)
    n = len(lines)
    # the request probes from its first assistant message on; the entry it leaves is
    # indexed from there too, or from its reply (a first turn: its prompt and itself)
    exact = assistant[-1] + 1 if assistant else None
    probe_at: list[int] = []
    if exact is not None:
        probe_at = sorted({*boundaries(assistant[0], n), exact}, reverse=True)
    mark_at = boundaries(assistant[0] if assistant else n, n + 1)[1:]  # n + 1: the reply
    wanted = {*probe_at, *mark_at}
    h = hashlib.sha256(_VERSION)
    h.update(scope_bytes(body, tenant) + b"\n")
    keys: dict[int, ConversationKey] = {}
    for j in range(n + 1):
        if j:
            h.update(lines[j - 1])
        if j in wanted:
            keys[j] = _key(tenant, h.hexdigest())
    return History(
        tenant,
        None if exact is None else keys[exact],
        tuple(keys[j] for j in probe_at),
        h,
        tuple(keys[j] for j in mark_at),
    )
