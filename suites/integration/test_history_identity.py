"""History identity through ``bidir-kv proxy`` on an emulated 1P1D: clients that send no id.

The client is the ``openai`` package, unmodified, sending no conversation id, header or
``prompt_cache_key``. Every turn's answer is compared with the same conversation on one
engine (no transfer); hits are counted twice, by the router's counter and by the tokens
P reports it took from D.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.client import CHAT_PATH, fetch, scrape
from bidir_kv.testing.router import (
    RouterProcess,
    chat,
    conversation_id,
    emulated_router_topology,
    long_opening,
    router_counter,
)

openai = pytest.importorskip("openai")

TOKENS = "vllm:prompt_tokens_by_source_total"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def topo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # as test_router_local: P without prefix caching (every token taken from D shows up
    # as external_kv_transfer), the engines' own guard off (only the router's stays)
    with emulated_router_topology(
        request.config,
        tmp_path_factory.mktemp("router-history"),
        prefix_caching_on_p=False,
        engine_args=("--kv-guard", "off"),
    ) as t:
        yield t


@pytest.fixture
def router(topo: Any, router_process: Callable[..., RouterProcess]) -> Callable[..., str]:
    """A fresh router in front of the shared engines (its counters start at zero)."""

    def start(*flags: str) -> str:
        return router_process(
            [(n.host, n.port) for n in topo.prefill],
            [(n.host, n.port) for n in topo.decode],
            extra=flags,
        ).url

    return start


def client(url: str, key: str = "alice") -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def pulled(topo: Any) -> float:
    return scrape(topo.prefill[0].url).value(TOKENS, source="external_kv_transfer")


def oracle(topo: Any, messages: list[dict[str, Any]]) -> str:
    """The same conversation on one engine, no transfer: the expected greedy text."""
    return chat(topo.prefill[0].url, messages, stream=False, max_tokens=MAX_TOKENS).text


def ask(api: Any, messages: list[dict[str, Any]], stream: bool) -> str:
    """One turn as an ordinary application makes it: no id of any kind."""
    if not stream:
        resp = api.chat.completions.create(
            model="tiny", messages=messages, temperature=0, max_tokens=MAX_TOKENS
        )
        return str(resp.choices[0].message.content or "")
    parts = []
    for chunk in api.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


def converse(
    topo: Any,
    url: str,
    tag: str,
    turns: int,
    stream: bool,
    key: str = "alice",
    mangle: Callable[[str], str] = lambda text: text,
) -> tuple[int, int, int]:
    """Run one conversation; (turns >= 2 that P served from D, router hits, wrong answers)."""
    api = client(url, key)
    msgs = long_opening(conversation_id(tag))
    from_d = wrong = 0
    hits0 = router_counter(url, "cache_hits")
    for turn in range(turns):
        before = pulled(topo)
        text = ask(api, msgs, stream)
        took = pulled(topo) - before
        wrong += text != oracle(topo, msgs)
        if turn > 0:
            from_d += took >= 64
        else:
            assert took == 0
        msgs = [
            *msgs,
            {"role": "assistant", "content": mangle(text)},
            {"role": "user", "content": f"Continue the story, part {turn + 2}."},
        ]
    return from_d, int(router_counter(url, "cache_hits") - hits0), wrong


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_openai_client_without_any_id_hits_every_later_turn(
    topo: Any, router: Callable[..., str], stream: bool
) -> None:
    url = router()  # --identity both, the default
    conversations, turns = 3, 4
    totals = [converse(topo, url, "oa", turns, stream) for _ in range(conversations)]
    later = conversations * (turns - 1)
    assert sum(t[2] for t in totals) == 0, "answers differ from the reference engine"
    assert sum(t[0] for t in totals) == later, f"P took D's KV on {totals} of {later} turns"
    assert sum(t[1] for t in totals) == later  # the router's counter agrees with P
    assert router_counter(url, "cache_misses", reason="no_history") == conversations


def test_the_same_with_the_redis_store(
    topo: Any, router: Callable[..., str], redis_server: Any
) -> None:
    url = router("--store", redis_server.url)
    from_d, hits, wrong = converse(topo, url, "redis", 4, stream=True)
    assert (from_d, hits, wrong) == (3, 3, 0)


def test_identity_id_keeps_the_upstream_behaviour(topo: Any, router: Callable[..., str]) -> None:
    url = router("--identity", "id")
    from_d, hits, wrong = converse(topo, url, "id-only", 3, stream=True)
    assert (from_d, hits, wrong) == (0, 0, 0)
    assert router_counter(url, "cache_misses", reason="no_id") == 3


def test_an_explicit_id_wins_over_the_history(topo: Any, router: Callable[..., str]) -> None:
    url, conv = router(), conversation_id("explicit")
    msgs = long_opening(conv)
    first = chat(url, msgs, conv, max_tokens=MAX_TOKENS)
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "and then?"},
    ]
    # the entry is under the id: the same history without the id does not find it
    assert chat(url, msgs2, max_tokens=MAX_TOKENS).status == 200
    assert router_counter(url, "cache_hits") == 0
    assert chat(url, msgs2, conv, max_tokens=MAX_TOKENS).status == 200
    assert router_counter(url, "cache_hits") == 1


def test_two_tenants_with_the_same_history_never_share(
    topo: Any, router: Callable[..., str]
) -> None:
    url = router()
    msgs = long_opening(conversation_id("tenants"))
    first = ask(client(url, "alice"), msgs, stream=True)
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": first},
        {"role": "user", "content": "and then?"},
    ]
    before = pulled(topo)
    forged = ask(client(url, "mallory"), msgs2, stream=True)
    assert pulled(topo) == before and router_counter(url, "cache_hits") == 0
    assert forged == oracle(topo, msgs2)
    # mallory's attempt neither read nor consumed alice's entry
    own = ask(client(url, "alice"), msgs2, stream=True)
    assert pulled(topo) - before >= 64 and router_counter(url, "cache_hits") == 1
    assert own == oracle(topo, msgs2)


def test_a_client_that_strips_the_reasoning_reuses_the_rest_and_answers_right(
    topo: Any, router: Callable[..., str]
) -> None:
    """The client drops the start of each answer (as a reasoning trace is dropped): the
    exact history is never found, but the previous turn is, under its own prompt (the
    longest prefix the two share), and the guard keeps only the tokens before the
    dropped part (issue #30; before it: 0 hits, every later turn ``not_found``)."""
    url = router()
    from_d, hits, wrong = converse(
        topo, url, "strip", 3, stream=True, mangle=lambda t: t.split(" ", 2)[-1]
    )
    assert (from_d, hits, wrong) == (2, 2, 0)
    assert router_counter(url, "history_matches", match="prefix") == 2
    assert router_counter(url, "guard_trims") == 2


def test_a_retried_request_never_takes_the_entry_twice(
    topo: Any, router: Callable[..., str]
) -> None:
    """Turn 2 sent twice: the first try takes turn 1's entry (exact history); the retry
    finds the first try's own turn under its prompt (a prefix of it), not turn 1's."""
    url = router()
    api = client(url)
    msgs = long_opening(conversation_id("retry"))
    first = ask(api, msgs, stream=True)
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": first},
        {"role": "user", "content": "and then?"},
    ]
    before = pulled(topo)
    answers = [ask(api, msgs2, stream=True) for _ in range(2)]  # a retry of the same turn
    assert answers == [oracle(topo, msgs2)] * 2
    assert router_counter(url, "cache_hits") == 2
    assert router_counter(url, "history_matches", match="exact") == 1
    assert router_counter(url, "history_matches", match="prefix") == 1
    assert router_counter(url, "cache_misses", reason="not_found") == 0
    assert pulled(topo) - before >= 2 * 64


def test_bad_messages_are_refused_before_any_engine(topo: Any, router: Callable[..., str]) -> None:
    url = router("--max-body-bytes", "100000")
    p0, d0 = scrape(topo.prefill[0].url), scrape(topo.decode[0].url)
    user = {"role": "user", "content": "hi"}
    malformed = [
        (
            [user, {"role": "assistant", "tool_calls": [{"id": "c"}]}],
            "messages[1].tool_calls[0].function",
        ),
        ([user, {"content": "x"}], "messages[1].role"),
        ([user, {"role": "user", "content": 7}], "messages[1].content"),
    ]
    for messages, field in malformed:
        reply = fetch(url + CHAT_PATH, method="POST", json={"model": "tiny", "messages": messages})
        assert reply.status == 400 and field in reply.json()["error"]["message"], reply.text
    deep: Any = "x"
    for _ in range(100):
        deep = [deep]
    deep_turn = [{"role": "user", "content": [{"type": "text", "text": deep}]}]
    reply = fetch(url + CHAT_PATH, method="POST", json={"model": "tiny", "messages": deep_turn})
    assert reply.status == 400 and "nests deeper" in reply.json()["error"]["message"]
    huge = [{"role": "user", "content": "x" * 200_000}]
    reply = fetch(url + CHAT_PATH, method="POST", json={"model": "tiny", "messages": huge})
    assert reply.status == 413
    for node, snap in ((topo.prefill[0], p0), (topo.decode[0], d0)):
        delta = scrape(node.url) - snap
        assert delta.value("vllm:prompt_tokens_total") == 0, f"{node.url} saw a request"


def test_bidir_kv_bench_without_ids_hits_every_later_turn(
    topo: Any, router: Callable[..., str], tmp_path: Path
) -> None:
    """``bidir-kv bench --no-send-conversation-id``: no body id, no header, yet hits."""
    url = router("--identity", "both")
    p0 = scrape(topo.prefill[0].url)
    conversations, turns = 3, 3
    argv = [
        sys.executable,
        "-m",
        "bidir_kv",
        "bench",
        "--url",
        url,
        "--legs",
        "on",
        "--metrics-url",
        f"prefill={topo.prefill[0].url}",
        "--metrics-url",
        f"router={url}",
        "--prefix-tokens",
        "300",
        "--num-conversations",
        str(conversations),
        "--num-turns",
        str(turns),
        "--input-tokens",
        "20",
        "--output-tokens",
        "6",
        "--no-send-conversation-id",
        "--no-progress",
        "--no-client-check",
        "-o",
        str(tmp_path / "res"),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    later = conversations * (turns - 1)
    assert router_counter(url, "cache_misses", reason="no_history") == conversations
    assert router_counter(url, "cache_misses", reason="no_id") == 0
    assert router_counter(url, "cache_hits") == later
    took = (scrape(topo.prefill[0].url) - p0).value(TOKENS, source="external_kv_transfer")
    assert took == router_counter(url, "cache_hit_tokens") and took >= 64 * later
