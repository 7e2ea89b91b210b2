"""The correctness oracle: disaggregated multi-turn output equals a single engine's.

KV bytes are a function of the token prefix and the next token a digest of the KV
actually present, so any wrong, stale or misaligned block changes the output. P runs
without a prefix cache (the AWS blog's setting), so every later turn pulls D's
whole history; conversations run four at a time through one long-lived pair.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from bidir_kv.client import CHAT_PATH, fetch
from bidir_kv.protocol import KVTransferParams
from bidir_kv.testing.engines import EnginePair, _start_pair, random_prompt, transport_names
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.topology.base import EngineSpec, TopologySpec
from bidir_kv.topology.local import LocalTopology

CONVERSATIONS = {"tcp": 200, "nixl": 60}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    spec = TopologySpec(num_prefill=1, num_decode=0, routers=0, prefill=EngineSpec())
    with LocalTopology(spec, tmp_path_factory.mktemp("reference")) as topo:
        yield EngineClient(topo.prefill[0])


def _conversation(pair: EnginePair, ref: EngineClient, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    prompt = random_prompt(rng, rng.randrange(64, 400))  # r >= 64: every later turn pulls
    prev: KVTransferParams | None = None
    stats = {"turns": 0, "mismatches": 0}
    for _ in range(rng.randrange(2, 4)):
        gen = rng.randrange(4, 24)
        stream = rng.random() < 0.5
        pr, dr = pair.turn(prompt, gen, prev, stream=stream)
        assert pr.ok and dr is not None and dr.ok, (seed, pr.error, dr and dr.error)
        want = ref.complete(prompt, gen)
        assert want.ok, want.error
        stats["turns"] += 1
        if dr.token_ids != want.token_ids:
            stats["mismatches"] += 1
        prev = dr.params
        prompt = [*prompt, *dr.token_ids, *random_prompt(rng, rng.randrange(10, 150))]
    return stats


@pytest.mark.slow
@pytest.mark.parametrize("transport", transport_names())
def test_oracle_over_random_conversations(
    transport: str, reference: EngineClient, tmp_path_factory: pytest.TempPathFactory
) -> None:
    pair = _start_pair(
        tmp_path_factory.mktemp(f"oracle-{transport}"),
        transport=transport,
        prefill={"enable_prefix_caching": False},
    )
    try:
        n = CONVERSATIONS[transport]
        p0 = pair.p.metrics()
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda s: _conversation(pair, reference, s), range(n)))
        delta = pair.p.metrics() - p0
        turns = sum(r["turns"] for r in results)
        mismatches = sum(r["mismatches"] for r in results)
        later_turns = turns - n
        assert mismatches == 0, f"{mismatches} of {turns} turns differ from the single engine"
        # pulls engaged: every later turn read D's history (no P cache, all >= threshold)
        assert delta.value("vllm:nixl_xfer_time_seconds_count") == later_turns
        assert delta.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
        assert delta.value("bidir_kv:kv_verify_mismatched_blocks_total") == 0
        assert delta.value("vllm:nixl_num_failed_transfers_total") == 0
        for which in ("p", "d"):
            st = pair.state(which)
            assert st["running"] == 0 and st["waiting"] == 0
    finally:
        pair.topo.close()


def _chat(
    url: str, messages: list[dict[str, str]], max_tokens: int, params: dict[str, Any] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    return (
        fetch(url + CHAT_PATH, method="POST", json=body, timeout=60)
        .raise_for_status()
        .json_object()
    )


def test_oracle_chat_text_round_trips(
    reference: EngineClient, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Text conversations through the chat template: generated text re-tokenizes to the
    same ids, so later turns are token-exact continuations and the oracle holds."""
    from bidir_kv.engine.model import WORDS

    pair = _start_pair(
        tmp_path_factory.mktemp("oracle-chat"), prefill={"enable_prefix_caching": False}
    )
    try:
        rng = random.Random("chat")
        p0 = pair.p.metrics()
        for _ in range(10):
            msgs = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=120))}]
            prev: dict[str, Any] | None = None
            for _turn in range(3):
                hit = (
                    KVTransferParams.miss().to_dict()
                    if prev is None
                    else {**prev, "do_remote_decode": True, "do_remote_prefill": False}
                )
                p = _chat(pair.p.url, msgs, 1, hit)
                d = _chat(pair.d.url, msgs, 12, p["kv_transfer_params"])
                want = _chat(reference.url, msgs, 12, None)
                assert (
                    d["choices"][0]["message"]["content"]
                    == want["choices"][0]["message"]["content"]
                )
                prev = d["kv_transfer_params"]
                msgs = [
                    *msgs,
                    {"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                    {"role": "user", "content": " ".join(rng.choices(WORDS, k=30))},
                ]
        assert (pair.p.metrics() - p0).value("vllm:nixl_xfer_time_seconds_count") == 20
    finally:
        pair.topo.close()


def test_oracle_holds_under_failed_transfers_with_recompute(
    reference: EngineClient, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A third of the reads fail on both sides; policy ``recompute`` must fall back to a
    local computation that is just as correct (and never hang)."""
    pair = _start_pair(
        tmp_path_factory.mktemp("oracle-faults"),
        prefill={"enable_prefix_caching": False},
        kv={"kv_load_failure_policy": "recompute"},
    )
    try:
        pair.set_faults("p", fail_transfers=0.34, seed=1)
        pair.set_faults("d", fail_transfers=0.34, seed=2)
        p0, d0 = pair.snap()
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda s: _conversation(pair, reference, 1000 + s), range(40)))
        p1, d1 = pair.snap()
        assert sum(r["mismatches"] for r in results) == 0
        failed = "vllm:nixl_num_failed_transfers_total"
        assert (p1 - p0).value(failed) > 0 and (d1 - d0).value(failed) > 0
        assert (p1 - p0).value("vllm:nixl_xfer_time_seconds_count") > 0  # some still pulled
    finally:
        pair.topo.close()
