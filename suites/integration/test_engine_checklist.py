"""docs/protocol.md §12.1 (upstream `test_bidirectional_kv_transfer.py`) at the HTTP level.

Upstream asserts scheduler state with fake model outputs; here the same behaviours
are observed on real engine processes through params, `/metrics` deltas and
`/_emulator/state` (our `assert_scheduler_empty`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest

from bidir_kv.client import COMPLETIONS_PATH, AsyncNodeClient
from bidir_kv.policy import cdiv
from bidir_kv.testing.engines import EnginePair, random_prompt, sources
from bidir_kv.testing.poll import wait_for
from bidir_kv.wire.params import advertises_verify

BS = 16
BLOCK_NBYTES = BS * 64
XFERS = "vllm:nixl_xfer_time_seconds_count"
BYTES = "vllm:nixl_bytes_transferred_sum"
MISMATCH = "bidir_kv:kv_verify_mismatched_blocks_total"
Factory = Callable[..., EnginePair]


def idle(pair: EnginePair, which: str) -> bool:
    st = pair.state(which)
    return st["running"] == st["waiting"] == st["leased"] == st["retained"] == 0


@pytest.mark.parametrize(("history", "pulls"), [(100, True), (99, False)])
def test_threshold_boundary_equal_pulls_one_less_recomputes(
    engine_pair: Factory, history: int, pulls: bool
) -> None:
    """count == T pulls (strictly-less-than comparison); T - 1 recomputes, notify-only."""
    pair = engine_pair(prefill={"enable_prefix_caching": False}, kv={"kv_recompute_threshold": 100})
    rng = random.Random(f"threshold-{history}")
    gen = 16
    prompt = random_prompt(rng, history - gen + 1)  # D computes prompt + gen - 1 = history
    _, d1 = pair.turn(prompt, gen)
    assert d1 is not None and d1.params is not None
    assert d1.params.remote_num_tokens == history
    prompt2 = [*prompt, *d1.token_ids, *random_prompt(rng, 40)]
    p0 = pair.p.metrics()
    pr = pair.p.complete(prompt2, 1, d1.params.for_prefill_hit())
    dp = pair.p.metrics() - p0
    assert pr.ok
    assert dp.value(XFERS) == (1 if pulls else 0)
    assert sources(dp)["external_kv_transfer"] == (history if pulls else 0)
    # either way D is told and frees its retained blocks
    wait_for(lambda: pair.state("d")["retained"] == 0)


def test_threshold_skip_is_logged_at_debug(engine_pair: Factory) -> None:
    pair = engine_pair(
        prefill={"env": (("VLLM_LOGGING_LEVEL", "DEBUG"),)}, kv={"kv_recompute_threshold": 256}
    )
    rng = random.Random("skip-debug")
    prompt = random_prompt(rng, 33)
    _, d1 = pair.turn(prompt, 16)  # D offers 48 tokens, P holds 32
    assert d1 is not None and d1.params is not None
    mark = pair.p.log_mark()
    prompt2 = [*prompt, *d1.token_ids, *random_prompt(rng, 20)]
    pr = pair.p.complete(prompt2, 1, d1.params.for_prefill_hit())
    assert pr.ok
    assert "Skipping remote pull for cmpl-" in pair.p.log_since(mark)
    assert ": 16 remote tokens < threshold 256" in pair.p.log_since(mark)


def test_lifecycle_holds_then_frees_everything(engine_pair: Factory) -> None:
    """P holds its blocks until D's read; D holds until P's read or its TTL; both end
    empty (upstream ``assert_scheduler_empty``)."""
    # D keeps blocks 5 s but exports a deadline 20 s later, so P never declines
    pair = engine_pair(decode_kv={"decoder_kv_blocks_ttl": 5.0})
    pair.set_faults("d", clock_skew=20.0)
    rng = random.Random("lifecycle")
    prompt = random_prompt(rng, 150)
    pr = pair.prefill(prompt, None)
    assert pr.params is not None and pair.state("p")["leased"] == 1
    dr = pair.d.complete(prompt, 100, pr.params)
    assert dr.ok and dr.params is not None
    wait_for(lambda: pair.state("p")["leased"] == 0)
    prompt2 = [*prompt, *dr.token_ids, *random_prompt(rng, 100)]
    p0 = pair.p.metrics()
    _, dr2 = pair.turn(prompt2, 8, dr.params)
    assert dr2 is not None and dr2.ok and dr2.params is not None
    assert (pair.p.metrics() - p0).value(XFERS) == 1  # one read, never a second
    wait_for(lambda: idle(pair, "p") and idle(pair, "d"), timeout=20)
    for which in ("p", "d"):
        st = pair.state(which)
        assert st["free_blocks"] == st["usable_blocks"]  # nothing referenced anymore


def test_aborted_request_frees_immediately_without_params(engine_pair: Factory) -> None:
    pair = engine_pair()
    prompt = random_prompt(random.Random("abort"), 64)
    body = pair.p.body(prompt, 2000, None, stream=True)
    body["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }

    async def first_chunk_then_leave() -> None:
        async with (
            AsyncNodeClient(pair.p.url, timeout=30) as client,
            client.open_stream(COMPLETIONS_PATH, body) as data,
        ):
            await anext(data)  # the first chunk arrived: the request is running

    asyncio.run(first_chunk_then_leave())
    wait_for(lambda: idle(pair, "p"))
    st = pair.state("p")
    assert st["free_blocks"] == st["usable_blocks"]


def test_partial_last_block_pulled_from_d(engine_pair: Factory) -> None:
    """remote_num_tokens of 2.5 blocks, prompt of 3.5 blocks, no local hit: P reads 3
    blocks (the last partial) and computes the rest (upstream
    test_p_node_pulls_partial_last_block_from_d)."""
    pair = engine_pair(prefill={"enable_prefix_caching": False}, kv={"kv_recompute_threshold": 0})
    rng = random.Random("partial")
    prompt = random_prompt(rng, 40 - 4 + 1)  # D computes 40 = 2.5 blocks
    _, d1 = pair.turn(prompt, 4)
    assert d1 is not None and d1.params is not None and d1.params.remote_num_tokens == 40
    prompt2 = [*prompt, *d1.token_ids, *random_prompt(rng, 56 - 41)]
    assert len(prompt2) == 56
    p0 = pair.p.metrics()
    assert pair.p.complete(prompt2, 1, d1.params.for_prefill_hit()).ok
    dp = pair.p.metrics() - p0
    assert dp.value(BYTES) == 3 * BLOCK_NBYTES
    assert sources(dp) == {"external_kv_transfer": 40, "local_compute": 16, "local_cache_hit": 0}


@pytest.mark.parametrize("pairing", ["position", "suffix-trim"])
def test_remote_blocks_exceed_prompt(engine_pair: Factory, pairing: str) -> None:
    """D holds more than P's (shorter, branched) prompt: count is capped at L. Position
    pairing reads D's first blocks and stays correct; vLLM's suffix trimming reads D's
    last blocks - the wrong positions (suspected upstream defect 3)."""
    # the guard is off so that pairing alone decides what is read
    pair = engine_pair(
        prefill={
            "enable_prefix_caching": False,
            "extra_args": ("--kv-pairing", pairing, "--kv-guard", "off"),
        },
        kv={"kv_recompute_threshold": 0},
    )
    rng = random.Random("exceed")
    prompt = random_prompt(rng, 200)
    _, d1 = pair.turn(prompt, 16)
    assert d1 is not None and d1.params is not None and d1.params.remote_num_tokens == 215
    short = prompt[:120]  # the client branched from an earlier point
    p0 = pair.p.metrics()
    pr = pair.p.complete(short, 1, d1.params.for_prefill_hit())
    dp = pair.p.metrics() - p0
    assert pr.ok
    assert sources(dp)["external_kv_transfer"] == 120
    assert dp.value(BYTES) == cdiv(120, BS) * BLOCK_NBYTES
    d = pair.d.complete(short, 8, pr.params)
    ref = pair.d.complete(short, 8)
    if pairing == "position":
        assert dp.value(MISMATCH) == 0
        assert d.token_ids == ref.token_ids
    else:
        assert dp.value(MISMATCH) == cdiv(120, BS)
        assert d.token_ids != ref.token_ids  # wrong KV gives different tokens


@pytest.mark.parametrize("guard", ["hashes", "off"])
def test_rewritten_history_guard(engine_pair: Factory, guard: str) -> None:
    """The next prompt edits D's last answer (docs/protocol.md §6.3). vLLM pulls KV of
    the old tokens; our default guard caps the pull at the verified prefix, so output
    equals recompute."""
    pair = engine_pair(
        prefill={"enable_prefix_caching": False, "extra_args": ("--kv-guard", guard)}
    )
    rng = random.Random("rewrite")
    prompt = random_prompt(rng, 200)
    _, d1 = pair.turn(prompt, 40)
    assert d1 is not None and d1.params is not None
    edited = [*d1.token_ids[:10], *random_prompt(rng, 30)]  # answer rewritten after token 10
    prompt2 = [*prompt, *edited, *random_prompt(rng, 50)]
    mark = pair.p.log_mark()
    p0 = pair.p.metrics()
    pr = pair.p.complete(prompt2, 1, d1.params.for_prefill_hit())
    dp = pair.p.metrics() - p0
    assert pr.ok and pr.params is not None
    # P's dict says whether P reads only what D's chain proves (docs/engine.md)
    assert advertises_verify(pr.params.extra) is (guard == "hashes")
    d2 = pair.d.complete(prompt2, 8, pr.params)
    # the reference is P without params: no prefix cache there, so a clean recompute
    # (D's cache may now hold the imported KV under prompt2's hashes, as vLLM's would)
    ref = pair.p.complete(prompt2, 8)
    if guard == "hashes":
        verified = 210 // BS * BS  # blocks before the edit
        assert sources(dp)["external_kv_transfer"] == verified
        assert dp.value("bidir_kv:kv_guard_rejected_tokens_total") == 239 - verified
        assert dp.value(MISMATCH) == 0
        assert "Prefix guard: prompt of cmpl-" in pair.p.log_since(mark)
        assert d2.token_ids == ref.token_ids
    else:
        assert sources(dp)["external_kv_transfer"] == 239
        assert dp.value(MISMATCH) > 0
        assert d2.token_ids != ref.token_ids
