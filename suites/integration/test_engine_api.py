"""HTTP surface of `bidir-kv engine`: OpenAI shapes, params placement per version, errors.

Shapes follow vLLM's OpenAI server (docs/protocol.md §3.1): params at the top level of a
non-streaming body and of the terminal SSE chunk; chat chunks carry ``null``
otherwise; ``--emulate-vllm 0.32`` streams carry none and dicts lack
``remote_registration_generation``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from bidir_kv.client import fetch
from bidir_kv.protocol import KVTransferParams, iter_sse_data
from bidir_kv.testing.engines import EnginePair, random_prompt

Factory = Callable[..., EnginePair]


def call(url: str, path: str, body: Any = None, *, raw: bytes | None = None) -> tuple[int, Any]:
    """(status, the answer decoded by its content type: SSE events, JSON or bytes)."""
    post = body is not None or raw is not None
    reply = fetch(
        url + path,
        method="POST" if post else "GET",
        json=body if raw is None else None,
        content=raw,
        headers={"Content-Type": "application/json"} if raw is not None else None,
        timeout=30,
    )
    if not reply.ok:
        return reply.status, json.loads(reply.content or b"null")
    ctype = reply.headers.get("content-type", "")
    if "event-stream" in ctype:
        return reply.status, [d for d in iter_sse_data(reply.content.splitlines()) if d]
    if "json" in ctype:
        return reply.status, reply.json()
    return reply.status, reply.content


def chunks(events: list[bytes]) -> list[dict[str, Any]]:
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    from bidir_kv.testing.engines import _start_pair

    p = _start_pair(tmp_path_factory.mktemp("api"))
    try:
        yield p
    finally:
        p.topo.close()


def test_health_models_tokenize(pair: EnginePair) -> None:
    url = pair.p.url
    assert call(url, "/health")[0] == 200
    status, version = call(url, "/version")
    assert status == 200 and version["version"] == "0.33.0"
    status, models = call(url, "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "tiny"
    msgs = [{"role": "user", "content": "hello kalo"}]
    status, tok = call(url, "/tokenize", {"messages": msgs})
    assert status == 200 and tok["count"] == len(tok["tokens"]) > 0
    assert tok["tokens"][0] == 3  # <|im_start|>: chat template, no BOS
    status, tok2 = call(url, "/tokenize", {"prompt": "hello kalo"})
    assert tok2["tokens"][0] == 1  # BOS for plain prompts
    # the chat endpoint sees the same tokens as /tokenize reports
    status, body = call(
        url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "ignore_eos": True}
    )
    assert status == 200 and body["usage"]["prompt_tokens"] == tok["count"]


def test_non_streaming_shapes(pair: EnginePair) -> None:
    prompt = random_prompt(random.Random("shapes"), 40)
    status, body = call(
        pair.d.url,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 3, "ignore_eos": True, "return_token_ids": True},
    )
    assert status == 200
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 3 and choice["finish_reason"] == "length"
    assert choice["prompt_token_ids"] == prompt
    assert body["usage"] == {
        "prompt_tokens": 40,
        "total_tokens": 43,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert "kv_transfer_params" in body and body["kv_transfer_params"] is None


def test_chat_stream_params_only_on_terminal_chunk(pair: EnginePair) -> None:
    msgs = [{"role": "user", "content": "kalo mine " * 20}]
    status, p_body = call(
        pair.p.url,
        "/v1/chat/completions",
        {
            "messages": msgs,
            "max_tokens": 1,
            "kv_transfer_params": KVTransferParams.miss().to_dict(),
        },
    )
    assert status == 200 and p_body["object"] == "chat.completion"
    p_params = p_body["kv_transfer_params"]
    status, events = call(
        pair.d.url,
        "/v1/chat/completions",
        {
            "messages": msgs,
            "max_tokens": 5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "kv_transfer_params": p_params,
        },
    )
    cs = chunks(events)
    assert cs[0]["choices"][0]["delta"]["role"] == "assistant"
    terminal = [c for c in cs if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(terminal) == 1
    assert terminal[0]["kv_transfer_params"]["do_remote_decode"] is True
    others = [c for c in cs if c is not terminal[0]]
    assert all("kv_transfer_params" in c and c["kv_transfer_params"] is None for c in others)
    assert cs[-1]["choices"] == [] and cs[-1]["usage"]["completion_tokens"] == 5
    # D copies P's cached-token count into its usage
    assert cs[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_emulate_032_no_stream_params_no_generation(engine_pair: Factory) -> None:
    pair = engine_pair(prefill={"emulate_vllm": "0.32"}, decode={"emulate_vllm": "0.32"})
    prompt = random_prompt(random.Random("v032"), 64)
    pr, dr = pair.turn(prompt, 4, stream=True)
    assert pr.params is not None
    assert "remote_registration_generation" not in pr.params.present
    assert dr is not None and dr.ok and dr.params is None and not dr.params_present
    _, dr2 = pair.turn(random_prompt(random.Random("v032b"), 64), 4)
    assert dr2 is not None and dr2.params is not None
    assert "remote_registration_generation" not in dr2.params.present
    assert dr2.params.remote_blocks_expiry_time is not None


def test_032_and_033_engines_refuse_to_handshake(engine_pair: Factory) -> None:
    """Like vLLM's compatibility hash: mixed versions do not exchange KV (docs/vllm-cpu.md §9)."""
    pair = engine_pair(prefill={"emulate_vllm": "0.32"})
    prompt = random_prompt(random.Random("mixed"), 64)
    d0 = pair.d.metrics()
    pr, dr = pair.turn(prompt, 4)
    assert pr.ok and dr is not None
    assert dr.status == 500  # D's P->D read failed under policy fail
    assert (pair.d.metrics() - d0).value("vllm:nixl_num_failed_transfers_total") == 1


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/completions", {"prompt": [1, 2, 99999]}, "token ids must be ints"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "model": "nope"}, "does not exist"),
        (
            "/v1/completions",
            {"prompt": "x", "kv_transfer_params": {"remote_port": "a"}},
            "remote_port",
        ),
        ("/v1/completions", {"prompt": [5] * 40000}, "maximum context length"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/completions", {"prompt": "x", "n": 2}, "'n' must be 1"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "'echo' is not supported"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True},
            "'use_beam_search' is not supported",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 1}},
            "'logit_bias' is not supported",
        ),
    ],
)
def test_bad_requests_name_the_problem(
    pair: EnginePair, path: str, body: dict[str, Any], needle: str
) -> None:
    status, err = call(pair.p.url, path, body)
    assert status in (400, 404)
    assert needle in err["error"]["message"]


def test_invalid_json_body(pair: EnginePair) -> None:
    status, err = call(pair.p.url, "/v1/completions", raw=b"{nope")
    assert status == 400 and "not valid JSON" in err["error"]["message"]


def test_missing_required_remote_key_logs_and_skips_transfer(pair: EnginePair) -> None:
    rng = random.Random("invalid-kv")
    prompt = random_prompt(rng, 100)
    _, d1 = pair.turn(prompt, 4)
    assert d1 is not None and d1.params is not None
    broken = d1.params.for_prefill_hit().without_fields("remote_request_id")
    mark = pair.p.log_mark()
    p0 = pair.p.metrics()
    pr = pair.p.complete([*prompt, *d1.token_ids, *random_prompt(rng, 100)], 1, broken)
    assert pr.ok
    assert "Got invalid KVTransferParams: " in pair.p.log_since(mark)
    assert "This request will not utilize KVTransfer" in pair.p.log_since(mark)
    assert (pair.p.metrics() - p0).value("vllm:nixl_xfer_time_seconds_count") == 0


def test_faults_endpoint_validates(pair: EnginePair) -> None:
    status, err = call(pair.p.url, "/_emulator/faults", {"fail_transfers": 2})
    assert status == 400 and "fail_transfers" in err["error"]["message"]
    status, err = call(pair.p.url, "/_emulator/faults", {"bogus": 1})
    assert status == 400 and "bogus" in err["error"]["message"]
    status, cur = call(pair.p.url, "/_emulator/faults")
    assert status == 200 and cur["fail_transfers"] == 0.0


def test_metrics_use_vllm_names(pair: EnginePair) -> None:
    names = pair.p.metrics().names()
    for n in (
        "vllm:nixl_xfer_time_seconds_count",
        "vllm:nixl_bytes_transferred_sum",
        "vllm:time_to_first_token_seconds_count",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert n in names, n


def test_max_num_seqs_queues_without_deadlock(engine_pair: Factory) -> None:
    """With one sequence slot, concurrent requests queue and all finish, same tokens."""
    from concurrent.futures import ThreadPoolExecutor

    pair = engine_pair(decode={"extra_args": ("--max-num-seqs", "1")})
    prompts = [random_prompt(random.Random(f"seqs-{i}"), 50) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda pr: pair.d.complete(pr, 6, stream=True), prompts))
    assert all(r.ok and len(r.token_ids) == 6 for r in results)
    for prompt, r in zip(prompts, results, strict=True):
        assert pair.d.complete(prompt, 6).token_ids == r.token_ids
