"""Who a request belongs to: the conversation id and the tenant that owns it.

The upstream example proxy keys its cache by the bare ``conversation_id``, so any
client that guesses an id reuses (and consumes) another client's KV. Here a key
is ``(tenant, conversation)``, the tenant being a digest of the ``Authorization``
header: a forged id from another tenant is a different key and can only miss.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Final

from bidir_kv.errors import IntakeError

__all__ = [
    "ANONYMOUS_TENANT",
    "ConversationKey",
    "IdentityError",
    "cache_salt_for",
    "conversation_key",
    "log_safe",
    "path_conversation_key",
    "tenant_digest",
]

ANONYMOUS_TENANT: Final = "anon"
MAX_CONVERSATION_ID_LEN: Final = 512


def log_safe(text: str, limit: int = 200) -> str:
    """Client text fit for one log line: control characters, non-ASCII and backslashes
    escaped (a newline in an id cannot forge a line), cut to ``limit`` characters."""
    cut = text[:limit]
    if cut.isprintable() and "\\" not in cut:
        out = cut
    else:
        out = cut.encode("unicode_escape").decode("ascii")
    return out + ("..." if len(text) > limit else "")


def cache_salt_for(tenant: str) -> str | None:
    """vLLM's per-request ``cache_salt`` for a tenant: prompts of different tenants
    never share prefix-cache blocks, so ``usage.cached_tokens`` cannot reveal how much
    of a guessed prompt another tenant sent. ``None`` for anonymous clients: they are
    one tenant already (one store namespace); a random salt per request would end
    their prefix hits, including the history P reads from D."""
    if tenant == ANONYMOUS_TENANT:
        return None
    return f"tenant-{tenant}"


class IdentityError(IntakeError, ValueError):
    """A malformed conversation id (wrong type, too long); the message says which."""


@dataclass(frozen=True, slots=True)
class ConversationKey:
    """A conversation as the store sees it; ``source`` says where the id came from."""

    tenant: str
    conversation_id: str
    source: str

    @property
    def storage_key(self) -> str:
        # A history digest lives in its own namespace ("#", never in a tenant digest):
        # no conversation id, whatever its text, names the same store key.
        sep = "#" if self.source == "history" else "/"
        return f"{self.tenant}{sep}{self.conversation_id}"

    def __str__(self) -> str:
        return self.conversation_id


def tenant_digest(authorization: str | None) -> str:
    """Short stable digest of the ``Authorization`` header (``anon`` without one)."""
    if not authorization:
        return ANONYMOUS_TENANT
    return hashlib.sha256(authorization.encode("utf-8", "surrogateescape")).hexdigest()[:24]


def _check_id(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise IdentityError(f"{where} must be a string, got {type(value).__name__}")
    if len(value) > MAX_CONVERSATION_ID_LEN:
        raise IdentityError(f"{where} is longer than {MAX_CONVERSATION_ID_LEN} characters")
    return value or None


def conversation_key(
    body: MutableMapping[str, Any], headers: Mapping[str, str]
) -> ConversationKey | None:
    """Extract (and remove from ``body``) the conversation id; ``None`` when there is none.

    Precedence: body ``conversation_id`` (upstream's field, never forwarded), then
    the ``X-Session-ID`` header (sent by vLLM's multi-turn benchmark), then OpenAI's
    ``prompt_cache_key`` (a standard field, left in the body).
    """
    from_body = _check_id(body.pop("conversation_id", None), "conversation_id")
    from_header = _check_id(headers.get("X-Session-ID"), "X-Session-ID header")
    from_key = _check_id(body.get("prompt_cache_key"), "prompt_cache_key")
    tenant = tenant_digest(headers.get("Authorization"))
    for value, source in (
        (from_body, "conversation_id"),
        (from_header, "X-Session-ID"),
        (from_key, "prompt_cache_key"),
    ):
        if value is not None:
            return ConversationKey(tenant=tenant, conversation_id=value, source=source)
    return None


def path_conversation_key(conversation_id: str, headers: Mapping[str, str]) -> ConversationKey:
    """The key of ``/v1/conversations/{id}`` for the caller's tenant (the same
    ``Authorization`` that sent its turns); :class:`IdentityError` for a bad id."""
    value = _check_id(conversation_id, "the conversation id in the path")
    if value is None:
        raise IdentityError("the conversation id in the path is empty")
    return ConversationKey(
        tenant=tenant_digest(headers.get("Authorization")), conversation_id=value, source="path"
    )
