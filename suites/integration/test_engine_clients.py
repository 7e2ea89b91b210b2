"""Request fields real clients send, and hostile bodies, against a running emulated engine.

Each field of vLLM's requests is honoured or refused with a 400 naming it
(``bidir_kv.engine.fields``); hostile bodies get 4xx naming the problem, never 500.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.client import fetch
from bidir_kv.engine.fields import REFUSED
from bidir_kv.launch.process import free_port
from bidir_kv.paths import REPO_ROOT
from bidir_kv.protocol import iter_sse_data
from bidir_kv.testing.engines import EnginePair, random_prompt

pytestmark = pytest.mark.integration


def post(
    url: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    ctype: str = "application/json",
) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body).encode()
    reply = fetch(
        url + path, method="POST", content=data, headers={"Content-Type": ctype}, timeout=60
    )
    if not reply.ok:
        return reply.status, json.loads(reply.content or b"null")
    if "event-stream" in reply.headers.get("content-type", ""):
        events = iter_sse_data(reply.content.splitlines())
        return reply.status, [json.loads(d) for d in events if d != b"[DONE]"]
    return reply.status, reply.json()


def complete(url: str, **body: Any) -> dict[str, Any]:
    status, out = post(url, "/v1/completions", body)
    assert status == 200, out
    return dict(out)


def chat(url: str, **body: Any) -> dict[str, Any]:
    body.setdefault("messages", [{"role": "user", "content": "hello there"}])
    status, out = post(url, "/v1/chat/completions", body)
    assert status == 200, out
    return dict(out)


def prompts(seed: str, count: int, length: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(rng, length) for _ in range(count)]


def test_min_tokens_equal_max_tokens_gives_exactly_that_many(shared_pair: EnginePair) -> None:
    url = shared_pair.p.url

    def one(p: list[int]) -> tuple[int, str]:
        out = complete(url, prompt=p, max_tokens=40, min_tokens=40)
        return out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, prompts("min_tokens", 100)))
    assert results == [(40, "length")] * 100


def test_no_turn_ends_at_its_first_token(shared_pair: EnginePair) -> None:
    url = shared_pair.p.url

    def one(p: list[int]) -> str:
        return str(complete(url, prompt=p, max_tokens=1)["choices"][0]["text"])

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, prompts("first-token", 400, 8)))
    assert all(texts), f"{texts.count('')} of 400 turns had empty content"


def test_stop_strings_and_include_stop_str(shared_pair: EnginePair) -> None:
    url = shared_pair.p.url
    p = prompts("stop", 1)[0]
    base = complete(url, prompt=p, max_tokens=12, ignore_eos=True)["choices"][0]["text"]
    word = base.split(" ")[4]  # the fourth generated word
    stop = " " + word
    cut = base.index(stop)
    out = complete(url, prompt=p, max_tokens=12, ignore_eos=True, stop=[stop])
    ch = out["choices"][0]
    assert (ch["text"], ch["finish_reason"], ch["stop_reason"]) == (base[:cut], "stop", stop)
    assert out["usage"]["completion_tokens"] == 4
    kept = complete(
        url, prompt=p, max_tokens=12, ignore_eos=True, stop=stop, include_stop_str_in_output=True
    )
    assert kept["choices"][0]["text"] == base[: cut + len(stop)]
    status, events = post(
        url,
        "/v1/completions",
        {"prompt": p, "max_tokens": 12, "stop": stop, "ignore_eos": True, "stream": True},
    )
    assert status == 200
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == base[:cut]


def test_stop_token_ids_and_min_tokens(shared_pair: EnginePair) -> None:
    url = shared_pair.p.url
    p = prompts("stop-ids", 1)[0]
    ids = complete(url, prompt=p, max_tokens=8, ignore_eos=True, return_token_ids=True)["choices"][
        0
    ]["token_ids"]
    out = complete(
        url, prompt=p, max_tokens=8, ignore_eos=True, stop_token_ids=[ids[2]], return_token_ids=True
    )
    ch = out["choices"][0]
    assert ch["token_ids"] == ids[:3]
    assert (ch["finish_reason"], ch["stop_reason"]) == ("stop", ids[2])
    held = complete(url, prompt=p, max_tokens=8, min_tokens=8, stop_token_ids=[ids[2]])
    assert held["usage"]["completion_tokens"] == 8
    assert held["choices"][0]["finish_reason"] == "length"


def test_cache_salt_separates_the_prefix_cache(shared_pair: EnginePair) -> None:
    url = shared_pair.p.url
    p = prompts("salt", 1, 80)[0]

    def cached(**salt: Any) -> int:
        out = complete(url, prompt=p, max_tokens=2, **salt)
        return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") == 64
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0
    status, err = post(url, "/v1/completions", {"prompt": p, "cache_salt": ""})
    assert status == 400 and "cache_salt" in err["error"]["message"]


def test_logprobs_have_vllms_shape(shared_pair: EnginePair) -> None:
    url = shared_pair.p.url
    out = chat(url, max_completion_tokens=5, logprobs=True, top_logprobs=2, ignore_eos=True)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 5
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
    comp = complete(url, prompt="hello", max_tokens=3, logprobs=1, ignore_eos=True)
    lp = comp["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert "".join(lp["tokens"]) == comp["choices"][0]["text"]
    status, err = post(
        url,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    )
    assert status == 400 and "top_logprobs" in err["error"]["message"]


def test_seed_n_and_max_completion_tokens(shared_pair: EnginePair) -> None:
    url = shared_pair.p.url
    out = chat(url, max_completion_tokens=3, max_tokens=50, seed=7, ignore_eos=True, n=1)
    assert out["usage"]["completion_tokens"] == 3
    status, err = post(url, "/v1/completions", {"prompt": "x", "n": 2})
    assert status == 400 and "'n'" in err["error"]["message"]
    status, err = post(url, "/v1/completions", {"prompt": "x", "seed": "s"})
    assert status == 400 and "'seed'" in err["error"]["message"]


def test_skip_special_tokens(shared_pair: EnginePair) -> None:
    url = shared_pair.p.url
    for p in prompts("eos", 50, 8):  # a turn that ends with EOS (about 1 in 4 at 30 tokens)
        out = complete(url, prompt=p, max_tokens=30)
        if out["choices"][0]["finish_reason"] == "stop":
            break
    else:
        pytest.fail("no turn ended with EOS")
    text = out["choices"][0]["text"]
    assert "<|eos|>" not in text
    shown = complete(
        url, prompt=p, max_tokens=30, skip_special_tokens=False, include_stop_str_in_output=True
    )
    assert shown["choices"][0]["text"] == text + "<|eos|>"
    status, err = post(url, "/v1/completions", {"prompt": "x", "skip_special_tokens": "no"})
    assert status == 400 and "skip_special_tokens" in err["error"]["message"]


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_fields_are_named(shared_pair: EnginePair, field: str) -> None:
    status, err = post(shared_pair.p.url, "/v1/completions", {"prompt": "x", field: 7})
    assert status == 400
    assert f"'{field}'" in err["error"]["message"]


@pytest.mark.parametrize(
    ("raw", "ctype", "status", "needle"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "application/json", 400, "nests deeper"),
        (
            b'{"prompt": ' + b"[" * 70 + b"1" + b"]" * 70 + b"}",
            "application/json",
            400,
            "nests deeper",
        ),
        (b'{"prompt": "a\\ud800b"}', "application/json", 400, "surrogate"),
        (b'{"prompt": "\xff\xfe"}', "application/json", 400, "not valid UTF-8"),
        (b'{"prompt": "x"}', "application/json; charset=klingon", 415, "klingon"),
        (b'{"prompt": "x", "stream": "false"}', "application/json", 400, "'stream'"),
        (b'{"prompt": "x", "stream": 0}', "application/json", 400, "'stream'"),
        (b'{"prompt": "x"', "application/json", 400, "not valid JSON"),
    ],
)
def test_hostile_bodies_get_4xx_naming_the_problem(
    shared_pair: EnginePair, raw: bytes, ctype: str, status: int, needle: str
) -> None:
    paths = ["/v1/completions", "/v1/chat/completions"]
    if "stream" not in needle:
        paths.append("/tokenize")
    for path in paths:
        got, err = post(shared_pair.p.url, path, raw=raw, ctype=ctype)
        assert got == status, (path, err)
        assert needle in err["error"]["message"], (path, err)


# ---- flags of the publication's recipe; bind failures ------------------------------------

BIN = str(Path(sys.executable).parent / "bidir-kv")


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BIN, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )


def test_recipe_flags_accepted_with_one_line_each_saying_what_is_emulated() -> None:
    cfg = json.dumps(
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cuda",
            "engine_id": "recipe",
            "kv_connector_extra_config": {"backends": ["LIBFABRIC"], "bidirectional_kv_xfer": True},
        }
    )
    proc = subprocess.Popen(
        [
            BIN,
            "engine",
            "tiny",
            "--port",
            str(free_port()),
            "--transport",
            "tcp",
            "--tensor-parallel-size",
            "8",
            "--kv-transfer-config",
            cfg,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
    )
    killer = threading.Timer(60, proc.kill)
    killer.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Starting vLLM API server" in line:
                break
    finally:
        killer.cancel()
        proc.terminate()
        proc.wait(timeout=20)
    log = "".join(lines)
    assert "tensor_parallel_size=8: emulating 8 ranks" in log, log
    assert sum("kv_buffer_device='cuda': emulated" in x for x in lines) == 1
    assert sum("NIXL backends ['LIBFABRIC']: emulated" in x for x in lines) == 1


def test_bind_failures_are_one_line() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = str(held.getsockname()[1])
        runs = {
            "engine http": _run(
                ["engine", "tiny", "--port", busy, "--transport", "tcp"],
                VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()),
            ),
            "side channel": _run(
                ["engine", "tiny", "--port", str(free_port()), "--transport", "tcp"],
                VLLM_NIXL_SIDE_CHANNEL_PORT=busy,
            ),
            "proxy": _run(
                [
                    "proxy",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    busy,
                    "--log-level",
                    "INFO",
                    "--prefiller-host",
                    "127.0.0.1",
                    "--prefiller-port",
                    "1",
                    "--decoder-host",
                    "127.0.0.1",
                    "--decoder-port",
                    "2",
                ]
            ),
        }
    for what, r in runs.items():
        errors = [x for x in r.stderr.splitlines() if "Traceback" in x or "error" in x.lower()]
        assert r.returncode == 1, (what, r.stderr)
        assert len(errors) == 1 and busy in errors[0] and "in use" in errors[0], (what, r.stderr)


def test_tokenizer_that_is_not_a_local_dir_is_one_line() -> None:
    r = _run(
        ["engine", "tiny", "--tokenizer", "Qwen/Qwen3-32B", "--port", str(free_port())],
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()),
    )
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "not a local directory" in r.stderr


# ---- --tokenizer: a client counting with the same HF tokenizer agrees with usage ---------


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny HF tokenizer, built without torch (about a second)."""
    out = tmp_path_factory.mktemp("tokenizer") / "tiny"
    subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "fixtures/tiny_model.py"),
            "--tokenizer-only",
            "--out",
            str(out),
        ],
        check=True,
        timeout=120,
    )
    return out


def _stream_chat(url: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    status, events = post(url, "/v1/chat/completions", body)
    assert status == 200, events
    text = "".join((c["delta"].get("content") or "") for e in events for c in e["choices"])
    usage = [e["usage"] for e in events if e.get("usage")]
    assert len(usage) == 1
    return text, usage[0]


def test_hf_tokenizer_counts_agree_with_usage_through_the_router(
    tiny_tokenizer: Path, run_dir: Path
) -> None:
    from transformers import AutoTokenizer

    from bidir_kv.testing.engines import kv_config
    from bidir_kv.topology.base import EngineSpec, TopologySpec
    from bidir_kv.topology.local import LocalTopology

    args = ("--tokenizer", str(tiny_tokenizer))
    spec = TopologySpec(
        # no prefix cache on P: turns >= 2 must pull D's retained KV (prompt + answer)
        prefill=EngineSpec(
            kv=kv_config("prefill"), transport="tcp", extra_args=args, enable_prefix_caching=False
        ),
        decode=EngineSpec(kv=kv_config("decode"), transport="tcp", extra_args=args),
    )
    client = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    rng = random.Random("hf-usage")
    words = ["kalo", "mine", "ruta", "vozi", "pesu", "dofa", "guhi", "jabo"]
    with LocalTopology(spec, run_dir) as topo:
        messages: list[dict[str, str]] = [
            {"role": "system", "content": " ".join(rng.choice(words) for _ in range(300))}
        ]
        previous = 0
        for turn in range(4):
            messages.append(
                {
                    "role": "user",
                    "content": f"turn {turn}: " + " ".join(rng.choice(words) for _ in range(20)),
                }
            )
            text, usage = _stream_chat(
                topo.router_url,
                {
                    "model": "tiny",
                    "messages": messages,
                    "max_tokens": 24,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "conversation_id": "hf-conv",
                },
            )
            ids = client.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            assert usage["prompt_tokens"] == len(ids), turn
            assert (
                usage["completion_tokens"]
                == len(client.encode(text, add_special_tokens=False))
                == 24
            ), turn
            # the previous prompt and answer re-encode to a token-exact prefix: all reused
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert turn == 0 or cached >= (previous + 24 - 1) // 16 * 16, (turn, cached)
            previous = usage["prompt_tokens"]
            messages.append({"role": "assistant", "content": text})
        from bidir_kv.client import scrape

        assert scrape(topo.router_url).value("bidir_kv_router_cache_hits_total") >= 3
        p2p = scrape(topo.prefill[0].url).value(
            "vllm:prompt_tokens_cached_by_source_total", source="p2p"
        )
        assert p2p > 0
