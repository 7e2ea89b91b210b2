"""cache_salt per tenant on both legs (stub engines record what they received)."""

from __future__ import annotations

from typing import Any

import pytest

from bidir_kv.router.identity import cache_salt_for, tenant_digest
from bidir_kv.testing.router import StubStack

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "same prompt"}],
        "max_tokens": 4,
        "stream": False,
        "conversation_id": "c",
        **extra,
    }


def salts(s: StubStack) -> list[Any]:
    """cache_salt of every client leg P and D received, in order (releases excluded)."""
    out = []
    for eng in (*s.prefill, *s.decode):
        out += [r["body"].get("cache_salt", "<none>") for r in eng.received if r["path"] == CHAT]
    return out


def test_rule() -> None:
    assert cache_salt_for(tenant_digest(None)) is None
    a, b = cache_salt_for(tenant_digest("Bearer a")), cache_salt_for(tenant_digest("Bearer b"))
    assert a and b and a != b and "Bearer" not in a


async def test_each_tenant_gets_its_own_salt_on_both_legs() -> None:
    async with StubStack() as s:
        for token in ("Bearer alice", "Bearer bob"):
            status, _, _ = await s.post(CHAT, body(), headers={"Authorization": token})
            assert status == 200
        alice = cache_salt_for(tenant_digest("Bearer alice"))
        bob = cache_salt_for(tenant_digest("Bearer bob"))
        p_salts = [r["body"].get("cache_salt") for r in s.prefill[0].received]
        d_salts = [r["body"].get("cache_salt") for r in s.decode[0].received]
        assert p_salts == [alice, bob] and d_salts == [alice, bob]


async def test_client_salt_is_kept_and_anonymous_gets_none() -> None:
    async with StubStack() as s:
        await s.post(CHAT, body(cache_salt="mine"), headers={"Authorization": "Bearer x"})
        await s.post(CHAT, body(conversation_id="anon"))
        assert salts(s) == ["mine", "<none>", "mine", "<none>"]
