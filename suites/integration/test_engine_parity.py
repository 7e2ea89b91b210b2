"""The numbers real vLLM showed on CPU (docs/vllm-cpu.md §7.5), reproduced by the emulator.

Same setup: block size 128, 1 KiB of KV per token (the tiny Llama: 2 layers x 2 KV
heads x 64 x bf16 x K/V), threshold 64, 16 generated tokens, token-id prompts.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from bidir_kv.testing.engines import EnginePair, random_prompt, sources

Factory = Callable[..., EnginePair]
BYTES = "vllm:nixl_bytes_transferred_sum"
XFERS = "vllm:nixl_xfer_time_seconds_count"
CPU_LIKE = {"block_size": 128, "kv_bytes_per_token": 1024, "max_model_len": 4096}


@pytest.fixture
def cpu_pair(engine_pair: Factory) -> EnginePair:
    return engine_pair(prefill=CPU_LIKE, decode=CPU_LIKE)


def test_turn1_and_turn2_deltas_match_vllm_cpu(cpu_pair: EnginePair) -> None:
    pair = cpu_pair
    rng = random.Random("cpu-7.5")
    prompt = random_prompt(rng, 2000)
    p0, d0 = pair.snap()
    pr, dr = pair.turn(prompt, 16)
    p1, d1 = pair.snap()
    assert dr is not None and dr.params is not None and pr.params is not None
    assert len(pr.params.remote_block_ids[0]) == 16 and pr.params.remote_num_tokens == 2000
    assert sources(p1 - p0)["local_compute"] == 2000
    assert sources(d1 - d0) == {
        "external_kv_transfer": 2000,
        "local_compute": 0,
        "local_cache_hit": 0,
    }
    assert (d1 - d0).value(BYTES) == 2_097_152
    assert dr.params.remote_num_tokens == 2015 and len(dr.params.remote_block_ids[0]) == 16

    prompt2 = [*prompt, *dr.token_ids, *random_prompt(rng, 300)]
    assert len(prompt2) == 2316
    _, dr2 = pair.turn(prompt2, 16, dr.params)
    p2, d2 = pair.snap()
    assert dr2 is not None and dr2.ok
    assert sources(p2 - p1) == {
        "local_cache_hit": 1920,
        "external_kv_transfer": 95,
        "local_compute": 301,
    }
    assert (p2 - p1).value(BYTES) == 131_072
    assert sources(d2 - d1) == {
        "local_cache_hit": 1920,
        "external_kv_transfer": 396,
        "local_compute": 0,
    }
    assert dr2.token_ids == pair.p.complete(prompt2, 16).token_ids  # the reference


def test_threshold_skip_matches_vllm_cpu(cpu_pair: EnginePair) -> None:
    pair = cpu_pair
    rng = random.Random("cpu-skip")
    prompt = random_prompt(rng, 1930)
    _, dr = pair.turn(prompt, 16)
    assert dr is not None and dr.params is not None and dr.params.remote_num_tokens == 1945
    prompt2 = [*prompt, *dr.token_ids, *random_prompt(rng, 300)]
    p1 = pair.p.metrics()
    assert pair.p.complete(prompt2, 1, dr.params.for_prefill_hit()).ok
    dp = pair.p.metrics() - p1
    assert sources(dp) == {"local_cache_hit": 1920, "external_kv_transfer": 0, "local_compute": 326}
    assert dp.value(XFERS) == 0
