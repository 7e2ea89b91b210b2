"""vLLM's P/D request flow against two `bidir-kv engine` processes (docs/protocol.md §1, §4, §5).

Each test drives P and D over HTTP exactly as docs/vllm-cpu.md §7.4 does (token-id
prompts, miss dict -> P, P's dict -> D, D's dict -> P next turn) and asserts on
the returned params and on `/metrics` deltas. The shared pair is reused across
tests; every test uses its own random prompts, so prefix caches never overlap.
"""

from __future__ import annotations

import random

import pytest

from bidir_kv.policy import cdiv
from bidir_kv.protocol import KVTransferParams
from bidir_kv.testing.engines import EnginePair, random_prompt, sources, transport_names
from bidir_kv.testing.poll import wait_for

BS = 16
BLOCK_NBYTES = BS * 64  # tiny profile: 64 KV bytes per token
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
NIXL_XFERS = "vllm:nixl_xfer_time_seconds_count"
FAILED = "vllm:nixl_num_failed_transfers_total"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
AFTER_EXPIRY = "vllm:nixl_num_notifications_after_expiry_total"
MISMATCH = "bidir_kv:kv_verify_mismatched_blocks_total"


@pytest.fixture(scope="module", params=transport_names())
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from bidir_kv.testing.engines import _start_pair

    p = _start_pair(tmp_path_factory.mktemp(f"pair-{request.param}"), transport=request.param)
    try:
        yield p
    finally:
        p.topo.close()


def rng_for(name: str) -> random.Random:
    return random.Random(name)


def test_turn1_miss_p_computes_and_d_pulls_everything(pair: EnginePair) -> None:
    prompt = random_prompt(rng_for("turn1"), 200)
    p0, d0 = pair.snap()
    pr, dr = pair.turn(prompt, 16)
    p1, d1 = pair.snap()
    assert pr.ok and dr is not None and dr.ok
    pp = pr.params
    assert pp is not None and pp.kind == "prefill"
    assert pp.do_remote_prefill and not pp.do_remote_decode
    assert pp.remote_num_tokens == 200 and pp.remote_blocks_expiry_time is None
    assert len(pp.remote_block_ids[0]) == cdiv(200, BS)
    assert pp.remote_prefill_cached_tokens == 0 and pp.transfer_mode == "pull"
    assert "remote_registration_generation" in pp.present
    assert sources(p1 - p0) == {
        "local_compute": 200,
        "local_cache_hit": 0,
        "external_kv_transfer": 0,
    }
    dd = d1 - d0
    assert sources(dd) == {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 200}
    assert dd.value(NIXL_BYTES) == cdiv(200, BS) * BLOCK_NBYTES
    assert dd.value(NIXL_XFERS) == 1
    assert (p1 - p0).value(NIXL_XFERS) == 0  # telemetry lives on the reader
    dp = dr.params
    assert dp is not None and dp.do_remote_decode and not dp.do_remote_prefill
    assert dp.remote_num_tokens == 200 + 16 - 1
    assert dp.remote_blocks_expiry_time is not None
    assert dp.remote_num_tokens <= len(dp.remote_block_ids[0]) * BS
    assert len(dp.remote_block_ids[0]) == cdiv(215, BS)
    assert "remote_prefill_cached_tokens" not in dp.present
    # P's blocks were freed by D's completion notification; D retains its own
    wait_for(lambda: pair.state("p")["leased"] == 0)
    assert pair.state("d")["retained"] >= 1


def test_turn2_local_prefix_first_then_pull_from_d(pair: EnginePair) -> None:
    """docs/vllm-cpu.md §7.5 with block 16: P's own cache first, the difference from D."""
    rng = rng_for("turn2")
    prompt = random_prompt(rng, 2000)
    _, d1 = pair.turn(prompt, 16)
    assert d1 is not None and d1.params is not None
    # P holds 2000 // 16 * 16 = 2000 tokens locally; make P hold less by a non-aligned start
    prompt2 = [*prompt, *d1.token_ids, *random_prompt(rng, 300)]
    p0, d0 = pair.snap()
    pr, dr = pair.turn(prompt2, 16, d1.params)
    p1, d1b = pair.snap()
    assert pr.ok and dr is not None and dr.ok
    h = 2000  # block-aligned local hit on P
    r = 2000 + 16 - 1
    count = min(r, len(prompt2)) - h  # 15 < 64: notify-only
    assert count == 15
    ps = sources(p1 - p0)
    assert ps == {
        "local_cache_hit": h,
        "external_kv_transfer": 0,
        "local_compute": len(prompt2) - h,
    }
    assert pr.cached_tokens == h
    # D's retained turn-1 blocks were released by the notify-only message
    ds = sources(d1b - d0)
    assert ds["local_cache_hit"] == 2015 // BS * BS
    assert ds["external_kv_transfer"] == len(prompt2) - 2015 // BS * BS


def test_turn2_pull_when_count_reaches_threshold(pair: EnginePair) -> None:
    """1930-token first turn: P hits 1920, D offers 1945 -> 25 < 64 recompute; a 1900
    first turn (hit 1888, offer 1915 -> 27) too; a 1800 + 100 generated turn pulls."""
    rng = rng_for("pull")
    prompt = random_prompt(rng, 1800)
    _, d1 = pair.turn(prompt, 100)
    assert d1 is not None and d1.params is not None
    prompt2 = [*prompt, *d1.token_ids, *random_prompt(rng, 300)]
    p0, _ = pair.snap()
    pr, dr = pair.turn(prompt2, 16, d1.params)
    p1, _ = pair.snap()
    assert pr.ok and dr is not None and dr.ok
    h = 1792  # 1800 aligned down
    count = 1800 + 100 - 1 - h
    assert count == 107
    dp = p1 - p0
    assert sources(dp) == {
        "local_cache_hit": h,
        "external_kv_transfer": count,
        "local_compute": len(prompt2) - h - count,
    }
    assert dp.value(NIXL_XFERS) == 1
    assert dp.value(NIXL_BYTES) == cdiv(h + count, BS) * BLOCK_NBYTES - h // BS * BLOCK_NBYTES
    assert dp.value(MISMATCH) == 0
    assert pr.params is not None and pr.params.remote_prefill_cached_tokens == h + count
    assert dr.cached_tokens == h + count  # D copies P's cached count into its usage


def test_second_notification_for_released_handle_is_reported(pair: EnginePair) -> None:
    """Re-sending D's dict after it was consumed: P is notify-only (full local hit) and D
    reports the unknown request (docs/protocol.md §5.2)."""
    rng = rng_for("renotify")
    prompt = random_prompt(rng, 300)
    _, d1 = pair.turn(prompt, 8)
    assert d1 is not None and d1.params is not None
    prompt2 = [*prompt, *d1.token_ids, *random_prompt(rng, 40)]
    pair.turn(prompt2, 4, d1.params)
    mark = pair.d.log_mark()
    d0 = pair.d.metrics()
    pr = pair.prefill(prompt2, d1.params.for_prefill_hit())
    assert pr.ok
    wait_for(lambda: (pair.d.metrics() - d0).value(AFTER_EXPIRY) == 1)
    log = pair.d.log_since(mark)
    assert (
        f"Potentially invalid KV blocks for unrecognized request {d1.params.remote_request_id}"
        in log
    )


def test_streaming_d_returns_params_on_terminal_chunk(pair: EnginePair) -> None:
    prompt = random_prompt(rng_for("stream"), 100)
    _, dr = pair.turn(prompt, 8, stream=True)
    assert dr is not None and dr.ok
    assert dr.params is not None and dr.params_on_terminal
    assert dr.params_chunk == dr.chunks - 1
    assert dr.params.remote_num_tokens == 100 + 8 - 1
    assert dr.nonterminal_params_values == []  # completions chunks carry no key


def test_oracle_disaggregated_equals_single_engine(pair: EnginePair) -> None:
    """Greedy tokens of a multi-turn P/D run equal a plain run of the same prompts."""
    rng = rng_for("oracle-small")
    prompt = random_prompt(rng, 500)
    prev: KVTransferParams | None = None
    for turn in range(3):
        _, dr = pair.turn(prompt, 12, prev)
        assert dr is not None and dr.ok
        ref = pair.d.complete(prompt, 12)  # D without params: a plain single-engine run
        assert dr.token_ids == ref.token_ids, f"turn {turn}"
        prev = dr.params
        prompt = [*prompt, *dr.token_ids, *random_prompt(rng, rng.randrange(20, 200))]
