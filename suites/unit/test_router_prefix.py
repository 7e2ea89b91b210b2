"""Longest-prefix lookup without an id (bidir_kv.router.prefix, history, the memory store
and the flow on stub engines): a request whose history shares a prefix with a stored turn
finds that turn, once, and only within its own scope."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bidir_kv.router.history import history_of
from bidir_kv.router.identity import tenant_digest
from bidir_kv.router.prefix import RECENT, boundaries
from bidir_kv.router.settings import RouterSettings
from bidir_kv.router.store import Entry, MemoryStore
from bidir_kv.testing.router import StubStack, counter
from suites.unit.test_router_flow import CHAT, chat_body, last_params, text_of

pytestmark = pytest.mark.unit

ALICE = tenant_digest("Bearer alice")


def msg(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": text}


def body(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": list(messages), **fields}


def stored_under(first: dict[str, Any], reply: str, tenant: str = ALICE) -> set[str]:
    """The keys a turn's entry is indexed under."""
    _, index = history_of(first, tenant).index_after(msg("assistant", reply))
    return {k.storage_key for k in index}


def probed(second: dict[str, Any], tenant: str = ALICE) -> list[str]:
    return [k.storage_key for k in history_of(second, tenant).probes]


def first_found(second: dict[str, Any], index: set[str]) -> int | None:
    """Position of the first probe naming the stored entry (what take_first takes)."""
    return next((i for i, k in enumerate(probed(second)) if k in index), None)


# ---- which boundaries ---------------------------------------------------------------


def test_boundaries_are_the_recent_ones_and_powers_of_two_longest_first() -> None:
    assert boundaries(3, 2) == []
    assert boundaries(1, 1) == [1]
    assert boundaries(0, 40) == [40, 39, 38, 37, 36, 35, 34, 33, 32, 16, 8, 4, 2, 1, 0]
    assert boundaries(5, 9) == [9, 8, 7, 6, 5]


@given(first=st.integers(0, 50), length=st.integers(0, 5000))
def test_a_history_costs_at_most_recent_plus_log2_keys(first: int, length: int) -> None:
    picked = boundaries(first, first + length)
    assert picked == sorted(set(picked), reverse=True)
    assert picked[0] == first + length and picked[-1] == first
    assert len(picked) <= RECENT + 2 + (math.log2(length) if length else 0)


@given(
    first=st.integers(0, 20),
    common=st.integers(0, 3000),
    tail_a=st.integers(0, 3000),
    tail_b=st.integers(0, 3000),
)
def test_two_histories_share_a_boundary_at_least_half_way_into_their_common_prefix(
    first: int, common: int, tail_a: int, tail_b: int
) -> None:
    """A stored turn and a later request that agree on ``first + common`` messages both
    use some boundary in the second half of that common prefix (or its last one)."""
    c = first + common
    shared = set(boundaries(first, c + tail_a)) & set(boundaries(first, c + tail_b))
    best = max(j for j in shared if j <= c)
    assert best >= first + common / 2


# ---- what a turn is indexed under and what a request probes --------------------------

U1, A1, U2 = msg("user", "Tell me about dragons."), "Dragons breathe fire.", msg("user", "more")


def test_a_replaced_reply_finds_the_turn_under_its_prompt() -> None:
    index = stored_under(body(U1), A1)
    exact = body(U1, msg("assistant", A1), U2)
    replaced = body(U1, msg("assistant", "A recorded answer instead."), U2)
    cut = body(U1, msg("assistant", A1[:9]), U2)
    assert first_found(exact, index) == probed(exact).index(
        history_of(exact, ALICE).lookup.storage_key  # type: ignore[union-attr]
    )
    for rewritten in (replaced, cut):
        assert first_found(rewritten, index) is not None
        assert probed(rewritten)[first_found(rewritten, index)] in index  # type: ignore[index]


def test_the_longest_shared_prefix_is_probed_first() -> None:
    turn2 = body(U1, msg("assistant", A1), U2)
    index2 = stored_under(turn2, "Castles too.")
    index1 = stored_under(body(U1), A1)
    # turn 3 rewrites turn 2's reply: turn 2's entry (4 messages shared) comes before
    # turn 1's (3 shared), and before turn 1's prompt (1 shared)
    turn3 = body(U1, msg("assistant", A1), U2, msg("assistant", "edited"), msg("user", "go"))
    order = probed(turn3)
    assert min(order.index(k) for k in index2 & set(order)) < min(
        order.index(k) for k in index1 & set(order)
    )


def test_a_first_turn_probes_nothing_so_it_cannot_take_another_conversations_turn() -> None:
    index = stored_under(body(U1), A1)
    assert probed(body(U1)) == []  # the same opening, another conversation
    assert probed(body(U1, U2)) == []
    assert index  # the stored turn itself is indexed


def test_another_tenant_or_scope_probes_other_keys() -> None:
    index = stored_under(body(U1), A1)
    second = body(U1, msg("assistant", "other"), U2)
    assert first_found(second, index) is not None
    assert not set(probed(second, tenant_digest("Bearer mallory"))) & index
    for field, value in (("model", "big"), ("cache_salt", "s2"), ("tools", [{"type": "x"}])):
        assert not set(probed({**second, field: value})) & index, field


# ---- the memory store: single use across index keys --------------------------------


def entry(tag: str) -> Entry:
    from bidir_kv.protocol import KVTransferParams

    params = KVTransferParams.build(
        do_remote_decode=True, remote_block_ids=[[1]], remote_request_id=tag
    )
    return Entry(params=params, decode="d", prefill="p", created=100.0)


async def test_an_entry_found_under_one_key_is_gone_under_all_of_them() -> None:
    store = MemoryStore(ttl=10, max_entries=10, now=lambda: 101.0)
    await store.put("t#full", entry("a"), index=["t#full", "t#p2", "t#p1"])
    taken = await store.take_first(["t#x", "t#p2"])
    assert taken.entry is not None and taken.matched == 1
    for key in ("t#full", "t#p2", "t#p1"):
        assert (await store.take_first([key])).entry is None
    assert store._index == {} and store._indexed == {}  # nothing left behind


async def test_the_newest_turn_wins_a_shared_key_and_the_older_keeps_its_own() -> None:
    store = MemoryStore(ttl=10, max_entries=10, now=lambda: 101.0)
    await store.put("t#a", entry("a"), index=["t#a", "t#shared"])
    await store.put("t#b", entry("b"), index=["t#b", "t#shared"])
    got = (await store.take_first(["t#shared"])).entry
    assert got is not None and got.params.remote_request_id == "b"
    got = (await store.take_first(["t#a"])).entry
    assert got is not None and got.params.remote_request_id == "a"


# ---- through the router: no id, a rewritten reply ------------------------------------


async def two_turns_without_id(s: StubStack, reply: str | None) -> None:
    msgs = [msg("user", "hello there, tell me a story")]
    status, _, events = await s.post(CHAT, chat_body(msgs, conv=None))
    assert status == 200
    answer = text_of(events)
    msgs2 = [*msgs, msg("assistant", answer if reply is None else reply), msg("user", "go on")]
    status, _, _ = await s.post(CHAT, chat_body(msgs2, conv=None))
    assert status == 200


@pytest.mark.parametrize("reply", [None, "REPLACED", "abc"], ids=["same", "replaced", "cut"])
async def test_a_rewritten_reply_without_an_id_reuses_the_shared_prefix(
    reply: str | None,
) -> None:
    async with StubStack() as s:
        await two_turns_without_id(s, reply)
        sent = last_params(s.prefill[0])
        assert sent is not None and sent.num_remote_tokens >= 32  # the first prompt's blocks
        assert counter(s.flow, "cache_hits") == 1
        match = "exact" if reply is None else "prefix"
        assert counter(s.flow, "history_matches", match=match) == 1
        if reply is not None:
            assert counter(s.flow, "guard_trims") == 1


async def test_identity_id_keeps_its_meaning() -> None:
    async with StubStack(config=RouterSettings(identity="id")) as s:
        await two_turns_without_id(s, "REPLACED")
        assert counter(s.flow, "cache_hits") == 0
        assert counter(s.flow, "cache_misses", reason="no_id") == 2


async def test_the_found_turn_is_taken_once() -> None:
    """Two rewrites of the same reply: the first reuses turn 1's blocks; the second finds
    the first rewrite's own turn (it shares the opening too), never turn 1's again."""
    async with StubStack() as s:
        msgs = [msg("user", "hello there, tell me a story")]
        await s.post(CHAT, chat_body(msgs, conv=None))
        offered = []
        for variant in ("one rewrite", "another rewrite"):
            again = [*msgs, msg("assistant", variant), msg("user", "go on")]
            assert (await s.post(CHAT, chat_body(again, conv=None)))[0] == 200
            sent = last_params(s.prefill[0])
            assert sent is not None and sent.num_remote_tokens > 0
            offered.append(sent.remote_request_id)
        assert offered[0] != offered[1]
        assert counter(s.flow, "history_matches", match="prefix") == 2
