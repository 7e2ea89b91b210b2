"""Hostile and invalid input at ``bidir-kv proxy``: always a 4xx naming the problem.

A router process in front of an emulated 1P1D pair, all on loopback. Requests D
would refuse must be refused before the P leg, so they cost P no prefill.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bidir_kv.client import CHAT_PATH, MalformedResponse, fetch, scrape
from bidir_kv.testing.router import RouterProcess, chat, emulated_router_topology

PROMPT_TOKENS = "vllm:prompt_tokens_total"


@pytest.fixture(scope="module")
def topo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with emulated_router_topology(request.config, tmp_path_factory.mktemp("router-input")) as t:
        yield t


@pytest.fixture
def own_router(topo: Any, router_process: Callable[..., RouterProcess]) -> RouterProcess:
    """A router of this test's own (its log is this test's alone)."""
    return router_process(
        [(n.host, n.port) for n in topo.prefill], [(n.host, n.port) for n in topo.decode]
    )


def post_raw(
    url: str,
    data: bytes,
    content_type: str = "application/json",
    path: str = CHAT_PATH,
) -> tuple[int, Any]:
    """POST raw bytes (what a JSON encoder would never send): (status, the JSON error
    object of a refusal, else the raw body)."""
    reply = fetch(
        url + path,
        method="POST",
        content=data,
        headers={"Content-Type": content_type},
        timeout=30,
    )
    if reply.ok:
        return reply.status, reply.content
    try:
        return reply.status, reply.json()
    except MalformedResponse:
        return reply.status, reply.content


def message(status: int, body: Any) -> str:
    assert 400 <= status < 500, f"expected a 4xx, got {status}: {body!r}"
    assert isinstance(body, dict) and "error" in body, body
    return str(body["error"]["message"])


def good_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4,
        **extra,
    }


def test_deep_nesting_is_a_400(topo: Any) -> None:
    for depth in (100, 100_000):
        raw = b'{"model": "tiny", "messages": ' + b"[" * depth + b"]" * depth + b"}"
        status, body = post_raw(topo.router_url, raw)
        assert "nests deeper" in message(status, body)


def test_lone_surrogate_is_a_400(topo: Any) -> None:
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    status, body = post_raw(topo.router_url, raw)
    assert "U+D800" in message(status, body)
    bad_utf8 = b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff"}]}'
    status, body = post_raw(topo.router_url, bad_utf8)
    assert "UTF-8" in message(status, body)


def test_unknown_charset_is_refused_naming_it(topo: Any) -> None:
    raw = json.dumps(good_body()).encode()
    status, body = post_raw(topo.router_url, raw, "application/json; charset=x-klingon")
    assert status == 415 and "x-klingon" in message(status, body)


@pytest.mark.parametrize("value", ["false", "true", 0, 1, [], {}])
def test_non_boolean_stream_is_a_400(topo: Any, value: Any) -> None:
    status, body = post_raw(topo.router_url, json.dumps(good_body(stream=value)).encode())
    assert "'stream' must be a boolean" in message(status, body)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"n": 2}, "'n'"),
        ({"stream": True, "stream_options": "usage"}, "stream_options"),
    ],
)
def test_what_d_would_refuse_never_reaches_p(topo: Any, extra: dict[str, Any], field: str) -> None:
    p_url = topo.prefill[0].url
    before = scrape(p_url).value(PROMPT_TOKENS)
    status, body = post_raw(topo.router_url, json.dumps(good_body(**extra)).encode())
    assert field in message(status, body)
    assert scrape(p_url).value(PROMPT_TOKENS) == before, "P prefilled a request D refuses"


def test_missing_prompt_or_messages_is_a_400(topo: Any) -> None:
    status, body = post_raw(topo.router_url, b'{"model": "tiny"}')
    assert "messages" in message(status, body)
    status, body = post_raw(topo.router_url, b'{"model": "tiny"}', path="/v1/completions")
    assert "prompt" in message(status, body)


_CHAT = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize(
    ("raw", "ctype"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "application/json"),
        (b'{"messages": ' + b"[" * 70 + b"]" * 70 + b"}", "application/json"),
        (_CHAT[:-1] + b', "x": "a\\ud800b"}]', "application/json"),
        (
            '{"model": "tiny", "messages": [{"role": "user", "content": "a\ud800"}]}'.encode(
                "utf-16-le", "surrogatepass"
            ),
            "application/json",
        ),
        (_CHAT + b"}", "application/json; charset=x-klingon"),
        (_CHAT + b"}", "application/json; charset=latin-1"),
        (_CHAT + b', "stream": "false"}', "application/json"),
        (_CHAT + b', "max_tokens": 0}', "application/json"),
        (_CHAT + b', "min_tokens": 5, "max_completion_tokens": 2}', "application/json"),
        (_CHAT + b', "stop": [1]}', "application/json"),
        (_CHAT + b', "logprobs": true, "top_logprobs": 21}', "application/json"),
        (_CHAT + b', "cache_salt": ""}', "application/json"),
        (b'{"model": "tiny"}', "application/json"),
    ],
)
def test_router_and_engine_refuse_alike(topo: Any, raw: bytes, ctype: str) -> None:
    """One set of checks (bidir_kv.intake): the router answers what the engine would."""
    via_router = post_raw(topo.router_url, raw, ctype)
    at_engine = post_raw(topo.decode[0].url, raw, ctype)
    assert via_router[0] == at_engine[0], (via_router, at_engine)
    assert message(*via_router) == message(*at_engine)


def test_utf16_json_is_read_as_vllm_reads_it(topo: Any) -> None:
    """JSON's own encoding detection decides, as in vLLM's server (charset ignored)."""
    raw = json.dumps(good_body(max_tokens=2)).encode("utf-16")
    for url in (topo.router_url, topo.decode[0].url):
        status, _ = post_raw(url, raw, "application/json; charset=utf-16")
        assert status == 200, url


def test_oversize_body_is_refused_before_it_is_read(topo: Any) -> None:
    """Content-Length far above the limit: 413 at once, though no body byte was sent."""
    host, port = topo.router_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n{"
        )
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"exceeds the limit" in reply


def test_control_characters_in_ids_cannot_forge_log_lines(own_router: RouterProcess) -> None:
    forged = "FORGED ERROR bidir_kv.router: everything is on fire"
    conv = f"c1\n{forged}\r\x1b[31m"
    res = chat(own_router.url, [{"role": "user", "content": "hi"}], conv, max_tokens=2)
    assert res.status == 200
    res = chat(
        own_router.url,
        [{"role": "user", "content": "hi"}],
        max_tokens=2,
        headers={"X-Session-ID": f"h\t{forged}"},
    )
    assert res.status == 200
    log = own_router.log()
    assert "c1\\n" + forged in log  # escaped on the line it belongs to
    assert not any(line.startswith(forged) for line in log.splitlines())
    assert "\x1b" not in log


def test_no_id_warning_names_the_client_side_fix(own_router: RouterProcess) -> None:
    # a chat turn without an id is recognised by its history (--identity both): no warning
    res = chat(own_router.url, [{"role": "user", "content": "hi"}], max_tokens=2)
    assert res.status == 200
    assert "No conversation_id" not in own_router.log()
    # a completions request has no history to recognise
    status, _ = post_raw(
        own_router.url,
        json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode(),
        path="/v1/completions",
    )
    assert status == 200
    warning = [ln for ln in own_router.log().splitlines() if "No conversation_id" in ln]
    assert warning, own_router.log()[-2000:]
    for fix in ("--send-conversation-id", "X-Session-ID", "prompt_cache_key", "conversation_id"):
        assert fix in warning[0]


def _cached_tokens(url: str, messages: list[dict[str, Any]], token: str | None) -> int:
    body = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0}
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    reply = fetch(url + CHAT_PATH, method="POST", json=body, headers=headers, timeout=60)
    out = reply.raise_for_status().json()
    return int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_another_tenant_sees_no_cached_tokens_of_a_guessed_prompt(topo: Any) -> None:
    """Prefix caching on P and D: tenant A's repeated prompt is served from cache, but
    tenant B sending the very same prompt is told 0 cached tokens (the router salts
    each tenant's requests), so usage cannot reveal what A sent."""
    messages = [{"role": "user", "content": "the secret plan: " + "rivers and castles " * 20}]
    assert _cached_tokens(topo.router_url, messages, "tenant-a-key") == 0
    assert _cached_tokens(topo.router_url, messages, "tenant-a-key") > 0  # A's own cache
    assert _cached_tokens(topo.router_url, messages, "tenant-b-key") == 0
