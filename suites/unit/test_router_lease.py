"""The renewable decode-side lease: its rule, its wire key, the store's lease clock, and
the router's keep-alive / close routes and idle sweep (stub engines, loopback)."""

from __future__ import annotations

from typing import Any

import pytest

from bidir_kv.policy import lease_deadline, lease_expired, valid_conversation_lease
from bidir_kv.protocol import KVTransferParams
from bidir_kv.router.conversations import LeaseSweeper
from bidir_kv.router.settings import RouterSettings
from bidir_kv.router.store import Entry, MemoryStore, Renewal
from bidir_kv.testing.doubles.stub_engine import StubEngine
from bidir_kv.testing.router import StubStack, counter
from bidir_kv.wire.params import LEASE_KEY, lease_of, lease_to_wire

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"


def test_lease_rule() -> None:
    assert lease_deadline(100.0, 30.0) == 130.0
    assert not lease_expired(130.0, 129.999)
    assert lease_expired(130.0, 130.0)  # renewed exactly ``idle`` ago: gone
    assert valid_conversation_lease(0.5) and valid_conversation_lease(30)
    for bad in (0, -1, float("inf"), float("nan"), True, "30", None):
        assert not valid_conversation_lease(bad), bad


def test_lease_wire_key() -> None:
    params = {"remote_num_tokens": 3, LEASE_KEY: lease_to_wire(30)}
    assert lease_of(params) == 30.0
    assert lease_of(KVTransferParams.parse(params).extra) == 30.0  # routers keep the key
    for bad in (
        None,
        {"v": 2, "idle_seconds": 30},
        {"v": 1, "idle_seconds": -1},
        {"v": 1, "idle_seconds": True},
        {"v": 1},
        "30",
    ):
        assert lease_of({LEASE_KEY: bad}) is None, bad
    assert lease_of({}) is None


def entry(created: float, lease: float | None) -> Entry:
    params = KVTransferParams.build(
        do_remote_decode=True,
        remote_block_ids=[[1, 2]],
        remote_engine_id="d",
        remote_request_id="r",
        remote_host="h",
        remote_port=1,
        remote_num_tokens=20,
    )
    return Entry(params=params, decode="d:1", prefill="p:1", created=created, lease=lease)


def test_entry_keeps_its_lease_on_the_wire() -> None:
    assert Entry.from_bytes(entry(1.0, 2.5).to_bytes()).lease == 2.5
    assert Entry.from_bytes(entry(1.0, None).to_bytes()).lease is None


async def test_memory_store_lease_clock() -> None:
    now = [1000.0]
    store = MemoryStore(ttl=100, max_entries=10, now=lambda: now[0])
    dropped: list[tuple[str, str]] = []
    store.on_evict = lambda e, why: dropped.append((e.decode, why))
    await store.put("t/a", entry(now[0], 10.0))
    await store.put("t/fixed", entry(now[0], None))
    now[0] += 9.0
    assert await store.expire_leases() == 0
    assert await store.renew("t/a") == Renewal(10.0, 1019.0)  # renewed at 1009
    now[0] += 9.0  # 18 s after the turn, 9 s after the keep-alive: still held
    assert await store.expire_leases() == 0
    assert await store.renew("t/fixed") == Renewal(None, None)
    assert await store.renew("t/unknown") is None
    now[0] += 1.0
    assert await store.expire_leases() == 1
    assert dropped == [("d:1", "lease_expired")]
    assert await store.renew("t/a") is None and (await store.take("t/a")).entry is None
    assert await store.end("t/fixed") and not await store.end("t/fixed")
    assert dropped[-1] == ("d:1", "closed")
    # a taken entry is never renewed nor expired; a stale one is not renewed
    await store.put("t/b", entry(now[0], 5.0))
    assert (await store.take("t/b")).entry is not None
    assert await store.renew("t/b") is None
    now[0] += 10.0
    assert await store.expire_leases() == 0
    await store.put("t/c", entry(now[0] - 101.0, 500.0))
    assert await store.renew("t/c") is None


def body(conv: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stream": True,
    }
    if conv is not None:
        out["conversation_id"] = conv
    return out


def releases(engine: StubEngine) -> list[dict[str, Any]]:
    return [
        r for r in engine.received if r["headers"].get("x-request-id", "").startswith("release-")
    ]


async def call(
    s: StubStack, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    assert s.session is not None
    async with s.session.request(method, s.url + path, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_close_keepalive_and_idle_expiry_through_the_router() -> None:
    now = [1000.0]
    store = MemoryStore(ttl=450, max_entries=100, now=lambda: now[0])
    cfg = RouterSettings(conversation_lease=5.0, lease_sweep_interval=0)
    async with StubStack(config=cfg, store=store) as s:
        sweeper = LeaseSweeper(store, s.flow.metrics, 0)
        for conv in ("a", "b"):
            status, _, _ = await s.post(CHAT, body(conv))
            assert status == 200
        st, ans = await call(s, "POST", "/v1/conversations/a/keepalive")
        assert st == 200 and ans["lease_seconds"] == 5.0 and ans["expires_in"] == 5.0
        st, ans = await call(s, "DELETE", "/v1/conversations/a")
        assert st == 200 and ans == {"id": "a", "object": "conversation.deleted", "deleted": True}
        await s.flow.releaser.drain()
        assert counter(s.flow, "releases", reason="closed") == 1
        (rel,) = releases(s.prefill[0])
        assert rel["body"]["kv_transfer_params"]["remote_num_tokens"] == 0
        for method, path in (
            ("DELETE", "/v1/conversations/a"),
            ("POST", "/v1/conversations/a/keepalive"),
            ("POST", "/v1/conversations/nobody/keepalive"),
        ):
            st, ans = await call(s, method, path)
            assert st == 404 and "'" in ans["error"]["message"], (method, path, ans)
        # another tenant cannot close or renew this tenant's conversation
        st, _ = await call(s, "DELETE", "/v1/conversations/b", {"Authorization": "x"})
        assert st == 404
        st, ans = await call(s, "DELETE", "/v1/conversations/" + "x" * 600)
        assert st == 400 and "longer than 512" in ans["error"]["message"]
        now[0] += 4.9
        assert await sweeper.sweep() == 0
        now[0] += 0.1
        assert await sweeper.sweep() == 1
        await s.flow.releaser.drain()
        assert counter(s.flow, "releases", reason="lease_expired") == 1
        assert counter(s.flow, "lease_expiries") == 1
        assert counter(s.flow, "conversation_closes", outcome="closed") == 1
        assert counter(s.flow, "conversation_keepalives", outcome="renewed") == 1
        assert counter(s.flow, "conversation_keepalives", outcome="not_found") == 2
        status, _, _ = await s.post(CHAT, body("b"))  # after expiry: a miss, answered
        assert status == 200
        assert counter(s.flow, "cache_misses", reason="not_found") == 3


async def test_keepalive_without_a_lease_is_409() -> None:
    async with StubStack() as s:  # stub D advertises no lease; no --conversation-lease
        await s.post(CHAT, body("c"))
        st, ans = await call(s, "POST", "/v1/conversations/c/keepalive")
        assert st == 409 and "--conversation-lease" in ans["error"]["message"]
        assert counter(s.flow, "conversation_keepalives", outcome="no_lease") == 1


def test_engine_config_key() -> None:
    """The emulated engine takes our connector's key (and refuses a bad value)."""
    from bidir_kv.config import ConfigError, KVTransferConfig

    def cfg(**extra: Any) -> KVTransferConfig:
        return KVTransferConfig.from_dict({"kv_connector_extra_config": extra})

    assert cfg(bidir_kv_lease_seconds=30).conversation_lease == 30.0
    assert cfg().conversation_lease is None
    assert (
        cfg(bidir_kv_lease_seconds=2).to_dict()["kv_connector_extra_config"][
            "bidir_kv_lease_seconds"
        ]
        == 2
    )  # passed on verbatim to a vLLM launched with it
    for bad in (0, -1, "30", True):
        with pytest.raises(ConfigError, match="bidir_kv_lease_seconds"):
            cfg(bidir_kv_lease_seconds=bad)
