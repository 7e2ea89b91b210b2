"""Issue #30's acceptance on the README quick start: a rewritten reply still reuses D's KV.

The topology is the README's first three commands as printed (P, D, the router with no
extra flag; ports rewritten to free ones; ``--store <redis url>`` appended for the Redis
case). Turn 1 is ~15.8k tokens. Turn 2 repeats it with the previous reply unchanged,
replaced by another text, or cut to half, followed by a new user message; the
conversation is named by ``conversation_id``, by ``X-Session-ID`` or not at all. What
each turn 2 reuses is read from P's ``vllm:prompt_tokens_cached_by_source_total
{source="p2p"}`` (tokens P read from D). A rewritten reply must reuse >= 90 % of what
the unchanged one reuses (before #30: 0 tokens in all six rewritten cases), and every
answer must equal a reference engine that recomputes everything (no prefix cache, no
transfer): the emulated model's next token is a digest of the KV present, so KV of other
tokens changes the answer.

A one-conversation test would find turn 1 in P's own prefix cache (P computed it), so
P's cache is churned first, as a busy P's is: ~290k tokens of other prompts sent straight
to P (its pool is 262k tokens), which evicts turn 1 and makes every reused token of
turn 2 come from D. The router's own trim is exercised by a third topology whose P runs
without the chain check (``--kv-guard off``, no verify advert, as stock vLLM): then the
router cuts D's dict with the block size it learned.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.client import get_json, scrape
from bidir_kv.launch.process import ManagedProcess, free_port, wait_http_ok
from bidir_kv.scrape import CACHED_BY_SOURCE
from bidir_kv.testing.gating import skip_or_fail
from bidir_kv.testing.router import chat
from bidir_kv.topology.base import BackendUnavailable
from bidir_kv.topology.redis_server import RedisServer
from suites.integration.test_readme_quickstart import PORTS, ported_quickstart

pytestmark = pytest.mark.integration

WORDS = 2000  # ~15.8k tokens of the builtin tokenizer: the 15.7k-token turn 1
FILLERS = 18  # x ~16k tokens > P's 262,144-token pool
IDENTITIES = ("conversation_id", "X-Session-ID", "none")
REPLIES = ("unchanged", "replaced", "half")


@dataclass
class QuickStart:
    router: str
    prefill: str
    reference: str
    logs: Path


@pytest.fixture(params=["memory", "redis", "router-trims"], scope="module")
def quickstart(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[QuickStart]:
    run = tmp_path_factory.mktemp(f"quickstart-{request.param}")
    ports = {p: str(free_port()) for p in PORTS}
    commands = [c[:-1].strip() for c in ported_quickstart(ports)[:3]]
    redis = RedisServer(run) if request.param == "redis" else None
    if redis is not None:
        try:
            redis.start()
        except BackendUnavailable as exc:
            redis.stop()
            skip_or_fail(request.config, "integration", str(exc))
        commands[2] += f" --store {redis.url}"
    if request.param == "router-trims":
        commands[0] += " --kv-guard off"  # P reads what the dict offers, as stock vLLM
    ref_port = free_port()
    # its own side-channel port: vLLM's default (5600) may be another test's
    commands.append(
        f"VLLM_NIXL_SIDE_CHANNEL_PORT={free_port()} bidir-kv engine tiny --port {ref_port} "
        "--transport tcp --no-enable-prefix-caching"
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    procs: list[ManagedProcess] = []
    try:
        for i, cmd in enumerate(commands):
            node = ManagedProcess(
                f"cmd{i}", ["bash", "-c", cmd], run / f"cmd{i}.log", env=env, cwd=run
            )
            procs.append(node.start())
        router = f"http://127.0.0.1:{ports['8000']}"
        reference = f"http://127.0.0.1:{ref_port}"
        # P and D first: the router answers /health before its first probe of them
        for port in ("8100", "8200"):
            wait_http_ok(f"http://127.0.0.1:{ports[port]}/health", 60)
        wait_http_ok(reference + "/health", 60)
        wait_http_ok(router + "/health", 60)
        # a port taken by another program between free_port() and the bind would make
        # /health answer for someone else: every command must still run, and the router
        # that answered must be ours (its P is our P)
        assert all(proc.returncode is None for proc in procs), "a quick-start command exited"
        nodes = [n["node"] for n in get_json(router + "/health")["prefill"]]
        assert nodes == [f"127.0.0.1:{ports['8100']}"], nodes
        yield QuickStart(router, f"http://127.0.0.1:{ports['8100']}", reference, run)
    finally:
        for proc in procs:
            proc.stop()
        if redis is not None:
            redis.stop()


def _p2p(url: str) -> float:
    return scrape(url).value(CACHED_BY_SOURCE, source="p2p")


def _turn(
    qs: QuickStart, messages: list[dict[str, Any]], identity: str, tag: str, max_tokens: int
) -> str:
    conv = tag if identity == "conversation_id" else None
    headers = {"X-Session-ID": tag} if identity == "X-Session-ID" else None
    res = chat(qs.router, messages, conv, headers=headers, max_tokens=max_tokens, timeout=120)
    assert res.status == 200, (res.status, res.raw[:300])
    expected = chat(qs.reference, messages, max_tokens=max_tokens, stream=False, timeout=120)
    assert res.text == expected.text, f"{tag}: the answer differs from a full recompute"
    return res.text


def _second_turn_reuse(qs: QuickStart, identity: str, reply: str) -> float:
    """Tokens P read from D for turn 2 of one conversation."""
    tag = f"qs-{identity}-{reply}-{os.getpid()}"
    words = " ".join(f"word{i % 997}" for i in range(WORDS))
    history = [{"role": "user", "content": f"{tag}: {words}"}]
    answer = _turn(qs, history, identity, tag, 32)
    sent_back = {
        "unchanged": answer,
        "replaced": "A different answer, as a benchmark replays a recorded one.",
        "half": answer[: len(answer) // 2],
    }[reply]
    for k in range(FILLERS):  # a busy P: its prefix cache no longer holds turn 1
        filler = [{"role": "user", "content": f"filler {tag} {k}: {words}"}]
        assert chat(qs.prefill, filler, max_tokens=1, stream=False, timeout=120).status == 200
    history += [
        {"role": "assistant", "content": sent_back},
        {"role": "user", "content": "Go on, please."},
    ]
    before = _p2p(qs.prefill)
    _turn(qs, history, identity, tag, 16)
    return _p2p(qs.prefill) - before


@pytest.mark.parametrize("identity", IDENTITIES)
def test_a_rewritten_reply_reuses_nearly_what_the_unchanged_one_does(
    quickstart: QuickStart, identity: str
) -> None:
    reused = {reply: _second_turn_reuse(quickstart, identity, reply) for reply in REPLIES}
    print(f"tokens read from D on turn 2 ({identity}): {reused}")  # the figures, with -s
    assert reused["unchanged"] >= 15_000, reused  # turn 1's history, read from D
    for reply in ("replaced", "half"):
        ratio = reused[reply] / reused["unchanged"]
        assert ratio >= 0.9, f"{identity}, reply {reply}: {reused} ({ratio:.3f})"
