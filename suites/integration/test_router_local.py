"""``bidir-kv proxy`` in front of emulated engines, all processes on loopback.

One 1P1D pair (P without prefix caching, as in the AWS recipe, so every token P
takes from D shows up as ``external_kv_transfer`` on P; the engines' own pull
guard off, as in vLLM) is shared by the module;
tests isolate themselves with unique conversations and assert on metric deltas.
Variants of the router (no guard, keep params, short TTL, Redis) are extra
router processes in front of the same engines.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bidir_kv.client import COMPLETIONS_PATH, fetch, get_json, scrape
from bidir_kv.launch.process import free_port
from bidir_kv.scrape import MetricsSnapshot
from bidir_kv.testing.poll import wait_for
from bidir_kv.testing.router import (
    ChatResult,
    RouterProcess,
    chat,
    conversation_id,
    emulated_router_topology,
    long_opening,
    router_counter,
)

TOKENS = "vllm:prompt_tokens_by_source_total"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"


@pytest.fixture(scope="module")
def topo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # --kv-guard off: the engines trust params like vLLM, so only the router's guard
    # stands between a rewritten history and wrong KV.
    with emulated_router_topology(
        request.config,
        tmp_path_factory.mktemp("router-local"),
        prefix_caching_on_p=False,
        engine_args=("--kv-guard", "off"),
    ) as t:
        yield t


@pytest.fixture
def extra_router(topo: Any, router_process: Callable[..., RouterProcess]) -> Callable[..., str]:
    """Start another router in front of the shared engines; returns its URL."""

    def start(*flags: str, prefill: list[tuple[str, int]] | None = None) -> str:
        rp = router_process(
            prefill or [(n.host, n.port) for n in topo.prefill],
            [(n.host, n.port) for n in topo.decode],
            extra=flags,
        )
        return rp.url

    return start


class Engines:
    """Metric deltas of P and D around a block of requests."""

    def __init__(self, topo: Any) -> None:
        self.topo = topo

    def snap(self) -> tuple[MetricsSnapshot, MetricsSnapshot]:
        return scrape(self.topo.prefill[0].url), scrape(self.topo.decode[0].url)


def p_pulled(topo: Any, fn: Callable[[], ChatResult]) -> tuple[ChatResult, float, MetricsSnapshot]:
    """Run ``fn``; return its result, P's external_kv_transfer tokens, and P's delta."""
    before = scrape(topo.prefill[0].url)
    res = fn()
    delta = scrape(topo.prefill[0].url) - before
    return res, delta.value(TOKENS, source="external_kv_transfer"), delta


def oracle(topo: Any, messages: list[dict[str, Any]], max_tokens: int = 12) -> str:
    """The same conversation on one engine, no transfer: the expected greedy text."""
    return chat(topo.prefill[0].url, messages, stream=False, max_tokens=max_tokens).text


def test_multi_turn_hits_pull_history_from_d_and_match_the_oracle(topo: Any) -> None:
    url, conv = topo.router_url, conversation_id("multi")
    msgs = long_opening(conv)
    hits0 = router_counter(url, "cache_hits")
    for turn in range(3):
        res, pulled, _ = p_pulled(topo, lambda m=msgs: chat(url, m, conv))  # type: ignore[misc]
        assert res.status == 200 and res.text
        assert res.text == oracle(topo, msgs), f"turn {turn + 1} differs from the oracle"
        if turn == 0:
            assert pulled == 0
        else:
            assert pulled >= 64, f"turn {turn + 1}: P pulled {pulled} tokens from D"
        msgs = [
            *msgs,
            {"role": "assistant", "content": res.text},
            {"role": "user", "content": f"Continue the story, part {turn + 2}."},
        ]
    assert router_counter(url, "cache_hits") - hits0 == 2


def test_without_conversation_id_nothing_is_reused(
    topo: Any, extra_router: Callable[..., str]
) -> None:
    """--identity id (the upstream proxy's way): no id, no reuse. The default also
    recognises a turn by its history (suites/integration/test_history_identity.py)."""
    url = extra_router("--identity", "id")
    msgs = long_opening(conversation_id("anon"))
    res = chat(url, msgs)
    msgs = [*msgs, {"role": "assistant", "content": res.text}, {"role": "user", "content": "go"}]
    res2, pulled, _ = p_pulled(topo, lambda: chat(url, msgs))
    assert res2.status == 200 and pulled == 0


def test_tenant_isolation(topo: Any) -> None:
    url, conv = topo.router_url, conversation_id("tenant")
    alice, mallory = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer mallory"}
    msgs = long_opening(conv)
    first = chat(url, msgs, conv, headers=alice)
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "and then?"},
    ]
    forged, pulled, _ = p_pulled(topo, lambda: chat(url, msgs2, conv, headers=mallory))
    assert forged.status == 200 and pulled == 0
    # mallory's attempt neither reused nor consumed alice's entry
    own, pulled_own, _ = p_pulled(topo, lambda: chat(url, msgs2, conv, headers=alice))
    assert own.status == 200 and pulled_own >= 64


def test_internal_params_never_reach_the_client(
    topo: Any, extra_router: Callable[..., str]
) -> None:
    forged = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_block_ids": [[1]],
        "remote_engine_id": "x",
        "remote_request_id": "x",
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),
        "remote_num_tokens": 16,
    }
    msgs = long_opening(conversation_id("strip"))
    for stream in (True, False):
        res = chat(
            topo.router_url,
            msgs,
            conversation_id("strip"),
            stream=stream,
            kv_transfer_params=forged,
        )
        assert res.status == 200
        assert b"kv_transfer_params" not in res.raw and b"remote_block_ids" not in res.raw
        assert b"token_ids" not in res.raw
    assert router_counter(topo.router_url, "client_kv_params_dropped") >= 2
    # control: the debug flag shows what stripping removes
    debug = extra_router("--keep-kv-params")
    res = chat(debug, msgs, conversation_id("strip"))
    assert b'"remote_block_ids"' in res.raw


def _diverging_turn(
    topo: Any, url: str, tag: str, mangle: Callable[[str], str]
) -> tuple[ChatResult, float, list[dict[str, Any]]]:
    conv = conversation_id(tag)
    msgs = long_opening(conv)
    first = chat(url, msgs, conv)
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": mangle(first.text)},
        {"role": "user", "content": "Please continue."},
    ]
    res, pulled, _ = p_pulled(topo, lambda: chat(url, msgs2, conv))
    return res, pulled, msgs2


def test_rewritten_history_is_not_reused_and_output_is_correct(
    topo: Any, extra_router: Callable[..., str]
) -> None:
    url = extra_router()  # guard on, block size known
    rejections = router_counter(url, "guard_rejections") + router_counter(url, "guard_trims")
    res, pulled, msgs2 = _diverging_turn(topo, url, "rewrite", lambda t: "I refuse. " + t)
    assert res.status == 200
    assert res.text == oracle(topo, msgs2)
    total = router_counter(url, "guard_rejections") + router_counter(url, "guard_trims")
    assert total - rejections == 1
    # what P took from D is at most the verified common prefix (the first user turn)
    assert pulled < 16 * 100


def test_stripped_reasoning_is_not_reused_and_output_is_correct(
    topo: Any, extra_router: Callable[..., str]
) -> None:
    """A template that drops the start of the answer (as reasoning parsers do)."""
    url = extra_router()
    res, _, msgs2 = _diverging_turn(topo, url, "strip-think", lambda t: t.split(" ", 2)[-1])
    assert res.status == 200 and res.text == oracle(topo, msgs2)


def test_unguarded_router_reuses_wrong_kv(topo: Any, extra_router: Callable[..., str]) -> None:
    """Control for the two tests above: upstream behaviour pulls D's blocks regardless."""
    url = extra_router("--no-continuation-guard")
    res, pulled, msgs2 = _diverging_turn(topo, url, "unguarded", lambda t: "I refuse. " + t)
    assert res.status == 200 and pulled >= 64
    assert res.text != oracle(topo, msgs2), "wrong KV should change the emulator's output"


def test_declined_read_falls_back_to_a_miss(topo: Any, extra_router: Callable[..., str]) -> None:
    """D exports an expiry already past: P declines (policy fail -> 500); the router retries."""
    url = topo.router_url
    conv = conversation_id("decline")
    msgs = long_opening(conv)
    d_url = topo.decode[0].url
    _set_faults(d_url, {"clock_skew": -10_000.0})
    try:
        first = chat(url, msgs, conv)
    finally:
        _set_faults(d_url, {"clock_skew": 0.0})
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "more please"},
    ]
    fallbacks = router_counter(url, "fallbacks", cause="prefill_http")
    res, pulled, delta = p_pulled(topo, lambda: chat(url, msgs2, conv))
    assert res.status == 200 and res.error is None
    assert res.text == oracle(topo, msgs2)
    assert delta.value(EXPIRED) >= 1, "P should have declined the expired read"
    assert router_counter(url, "fallbacks", cause="prefill_http") - fallbacks == 1
    assert pulled == 0


def _set_faults(url: str, faults: dict[str, Any]) -> None:
    fetch(url + "/_emulator/faults", method="POST", json=faults).raise_for_status()


def test_prefill_down_gives_503_naming_it(topo: Any, extra_router: Callable[..., str]) -> None:
    dead = free_port()
    url = extra_router(prefill=[("127.0.0.1", dead)])
    res = chat(url, long_opening("p-down"), conversation_id("p-down"))
    assert res.status == 503
    assert "no healthy prefill node" in res.error["message"]
    assert f"127.0.0.1:{dead}" in res.error["message"]


def test_stale_entry_is_discarded(topo: Any, extra_router: Callable[..., str]) -> None:
    import time

    url = extra_router("--cache-ttl", "0.3")
    conv = conversation_id("stale")
    msgs = long_opening(conv)
    first = chat(url, msgs, conv)
    stored_at = time.monotonic()
    assert router_counter(url, "cache_stores") == 1
    # The entry's age is what is under test: let the TTL pass (not a synchronization).
    time.sleep(max(0.0, stored_at + 0.5 - time.monotonic()))
    msgs2 = [*msgs, {"role": "assistant", "content": first.text}, {"role": "user", "content": "?"}]
    res, pulled, _ = p_pulled(topo, lambda: chat(url, msgs2, conv))
    assert res.status == 200 and pulled == 0
    assert router_counter(url, "cache_stale") == 1
    assert router_counter(url, "cache_hits") == 0


def test_openai_client_through_the_router(topo: Any) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=topo.router_url + "/v1", api_key="sk-test")
    conv = conversation_id("openai")
    msgs: list[dict[str, Any]] = long_opening(conv)
    stream = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"conversation_id": conv},
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == oracle(topo, msgs)
    msgs = [*msgs, {"role": "assistant", "content": text}, {"role": "user", "content": "next"}]
    before = scrape(topo.prefill[0].url)
    out = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=12,
        temperature=0,
        extra_body={"conversation_id": conv},
    )
    pulled = (scrape(topo.prefill[0].url) - before).value(TOKENS, source="external_kv_transfer")
    assert out.choices[0].message.content == oracle(topo, msgs)
    assert pulled >= 64
    assert getattr(out, "kv_transfer_params", None) is None


def _complete(url: str, prompt: list[int], conv: str | None, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 10,
        "temperature": 0,
        "stream": stream,
        "return_token_ids": True,
    }
    if conv:
        body["conversation_id"] = conv
    raw = fetch(url + COMPLETIONS_PATH, method="POST", json=body, timeout=60)
    raw = raw.raise_for_status().content
    if not stream:
        out: dict[str, Any] = json.loads(raw)
        return {"ids": out["choices"][0]["token_ids"], "raw": raw}
    ids: list[int] = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            for c in json.loads(line[6:]).get("choices") or []:
                ids += c.get("token_ids") or []
    return {"ids": ids, "raw": raw}


@pytest.mark.parametrize("stream", [True, False])
def test_completions_with_token_ids_the_client_asked_for(topo: Any, stream: bool) -> None:
    """Token-id prompts (as the conformance tier sends them); the client's own
    ``return_token_ids`` is honoured, not stripped, and turn 2 reuses D's KV."""
    url, conv = topo.router_url, conversation_id("compl")
    prompt = [300 + (i * 7) % 500 for i in range(150)]
    first = _complete(url, prompt, conv, stream)
    assert len(first["ids"]) == 10 and b"kv_transfer_params" not in first["raw"]
    prompt2 = prompt + first["ids"] + [301, 302, 303]
    before = scrape(topo.prefill[0].url)
    second = _complete(url, prompt2, conv, stream)
    pulled = (scrape(topo.prefill[0].url) - before).value(TOKENS, source="external_kv_transfer")
    assert pulled >= 64
    direct = _complete(topo.prefill[0].url, prompt2, None, False)
    assert second["ids"] == direct["ids"]


def test_rejected_hit_releases_ds_pinned_blocks_early(
    topo: Any, router_process: Callable[..., RouterProcess]
) -> None:
    """A guard rejection (the history differs from D's within its first block, so
    nothing is left to trim) sends D's dict with remote_num_tokens=0: P recomputes, but
    notifies D, which frees the pinned turn now, not at the TTL."""

    url = router_process(
        [(n.host, n.port) for n in topo.prefill], [(n.host, n.port) for n in topo.decode]
    ).url
    d_state = topo.decode[0].url + "/_emulator/state"
    retained0 = get_json(d_state)["retained"]
    conv = conversation_id("release")
    msgs = long_opening(conv)
    first = chat(url, msgs, conv)
    msgs2 = [
        {"role": "user", "content": "No. " + msgs[0]["content"]},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Please continue."},
    ]
    res, pulled, _ = p_pulled(topo, lambda: chat(url, msgs2, conv))
    assert res.status == 200 and pulled == 0 and res.text == oracle(topo, msgs2)
    assert router_counter(url, "guard_rejections", reason="mismatch") == 1
    # turn 1's pinned blocks are gone, turn 2's are pinned: one more than before
    wait_for(
        lambda: get_json(d_state)["retained"] == retained0 + 1,
        10,
        "D to free turn 1's pinned blocks (one more retained than before)",
    )


@pytest.mark.parametrize("conv_id", [True, False], ids=["id", "no-id"])
def test_a_trimmed_hit_frees_the_rest_of_ds_blocks_at_once(
    topo: Any, extra_router: Callable[..., str], conv_id: bool
) -> None:
    """A rewritten reply reuses only the shared prefix of turn 1's blocks; the rest are
    not left pinned until D's TTL: P's read ends with its notification, and D frees
    the whole turn then (turn 2's own retained turn is the only one more than before)."""
    url = extra_router()
    d_state = topo.decode[0].url + "/_emulator/state"
    retained0 = get_json(d_state)["retained"]
    conv = conversation_id("trim-free")
    msgs = long_opening(conv)
    first = chat(url, msgs, conv if conv_id else None)
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": "A recorded answer, not the one D gave."},
        {"role": "user", "content": "Please continue."},
    ]
    trims = router_counter(url, "guard_trims")
    res, pulled, _ = p_pulled(topo, lambda: chat(url, msgs2, conv if conv_id else None))
    assert first.status == res.status == 200 and res.text == oracle(topo, msgs2)
    assert router_counter(url, "guard_trims") - trims == 1 and pulled >= 64
    wait_for(
        lambda: get_json(d_state)["retained"] == retained0 + 1,
        10,
        "D to free turn 1's blocks (only turn 2's retained turn left)",
    )
