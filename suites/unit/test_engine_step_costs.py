"""What one emulated step costs: each prefill chunk at its own context, the per-request
terms once per request on the side that computes the prompt, D's part of TTFT.

Why: a step that finishes one long prompt and starts another (vLLM V1 fills the
token budget that way, docs/engine.md "Scheduling") used to price every token at
the longest context in the step, which put a step into the OFF curve where prompts
start to be chunked (issue 24). The calibrated profile's per-request terms (the
fixed prefill part, P's work per pulled token) must be paid once per request, by
P, not again by D's one-token tail.
"""

from __future__ import annotations

from typing import Any, cast

import pytest

from bidir_kv.config import KVTransferConfig
from bidir_kv.engine.compute import ModelRunner
from bidir_kv.engine.kvcache import BlockManager
from bidir_kv.engine.metrics import EngineMetrics
from bidir_kv.engine.profiles import CostProfile
from bidir_kv.engine.request import Request
from bidir_kv.engine.settings import EngineSettings
from bidir_kv.engine.steps import StepLoop
from bidir_kv.engine.transport.base import KVPool
from bidir_kv.protocol import KVTransferParams

BS, LAYERS = 16, 2


def _loop(profile: CostProfile, budget: int) -> StepLoop:
    settings = EngineSettings(
        model="m",
        served_names=["m"],
        kv=KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_both"}),
        profile=profile,
        max_num_batched_tokens=budget,
    )
    pool = KVPool.allocate(128, BS * profile.kv_bytes_per_token)
    blocks = BlockManager(pool, BS, LAYERS, enable_prefix_caching=False)
    none = cast(Any, None)  # the chunk pricing needs neither the reader nor the owner
    return StepLoop(
        settings, blocks, ModelRunner(blocks), EngineMetrics("m"), reader=none, owner=none
    )


def _running(loop: StepLoop, rid: str, n: int, first_block: int, **fields: Any) -> Request:
    req = Request(rid, list(range(100, 100 + n)), 1, **fields)
    req.tokens = list(req.prompt)
    req.blocks = list(range(first_block, first_block + -(-n // BS)))
    req.state = "running"
    loop.running.append(req)
    return req


def test_a_shared_step_prices_each_chunk_at_its_own_context() -> None:
    # attention only: 1 µs per new token per 1k context tokens
    prof = CostProfile(
        "attn", prefill_us_per_token_ctx=1.0, kv_bytes_per_token=LAYERS * 4, num_layers=LAYERS
    )
    loop = _loop(prof, budget=1000)
    a = _running(loop, "a", 480, 1)
    a.num_computed, a.prefill_started = 320, True  # A's last chunk: 160 tokens after 320
    _running(loop, "b", 960, 40)  # B starts: 840 of its tokens fit the rest of the budget
    tokens, seconds = loop._prefill_chunks(1000, [])
    assert tokens == 1000
    own = prof.prefill_seconds(160, 320) + prof.prefill_seconds(840, 0)
    assert seconds == pytest.approx(own)
    # the whole step at the longest context (the old pricing) is dearer by B's attention
    assert prof.prefill_seconds(1000, 320) > own * 1.9


def test_per_request_terms_once_and_only_where_the_prompt_is_computed() -> None:
    prof = CostProfile(
        "fixed",
        prefill_us_per_token=1.0,
        prefill_fixed_us=5000.0,
        pull_after_us_per_token=2.0,
        kv_bytes_per_token=LAYERS * 4,
        num_layers=LAYERS,
    )
    loop = _loop(prof, budget=64)
    p_side = _running(loop, "p", 96, 1, params=KVTransferParams(do_remote_decode=True))
    p_side.num_computed, p_side.external_tokens = 48, 48  # pulled 48 from D
    d_side = _running(loop, "d", 32, 20, params=KVTransferParams(do_remote_prefill=True))
    d_side.num_computed = 31  # D recomputes the last token after its pull from P
    _, first = loop._prefill_chunks(64, [])  # P's 48 and D's 1 token
    assert first == pytest.approx((49 * 1.0 + 5000.0 + 48 * 2.0) * 1e-6)
    loop.running.remove(d_side)
    p_side.num_computed = 48  # a later chunk of the same request: no per-request terms again
    _, again = loop._prefill_chunks(16, [])
    assert again == pytest.approx(16 * 1.0 * 1e-6)


def test_d_part_of_ttft_replaces_the_wire_model_for_d_pulls() -> None:
    wire = CostProfile(
        "wire",
        kv_bytes_per_token_target=1000,
        transfer_overhead_us=100.0,
        transfer_gbytes_per_s=1.0,
    )
    assert wire.decode_pull_seconds(5000) is None  # derived profiles: the wire model
    part = CostProfile(
        "part",
        decode_us_per_step=500.0,
        decode_ttft_fixed_us=1000.0,
        decode_ttft_us_per_token=2.0,
        time_scale=2.0,
    )
    # D's part less the decode step the step loop spends itself, time-scaled
    assert part.decode_pull_seconds(5000) == pytest.approx((1000 + 10_000 - 500) * 2e-6)
    assert part.decode_pull_seconds(0) == pytest.approx((1000 - 500) * 2e-6)


class _Clock:
    """A virtual clock for the step loop: each sleep wakes ``late`` seconds after its
    deadline (the event loop's millisecond timer), and everything the loop does between
    sleeps costs nothing, so the test sees only how steps are paced."""

    def __init__(self, late: float) -> None:
        self.now, self.late = 100.0, late

    def perf_counter(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds) + self.late


def test_decode_steps_keep_the_profiles_pace_however_late_each_wake_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    from bidir_kv.engine import steps

    prof = CostProfile(
        "dec", decode_us_per_step=4000.0, kv_bytes_per_token=LAYERS * 4, num_layers=LAYERS
    )
    clock = _Clock(late=0.0008)  # each wake-up 0.8 ms late: 20 % of a 4 ms step
    loop = _loop(prof, budget=64)
    req = _running(loop, "r", 16, 1, ignore_eos=True)
    req.blocks = list(range(1, 21))  # room for 320 tokens
    req.num_computed, req.max_tokens = 16, 10_000  # decoding, never finishing here
    req.tokens.append(200)  # the first token, sampled at the prefill's end
    req.output.append(200)

    async def scenario() -> tuple[float, float]:
        monkeypatch.setattr(steps.time, "perf_counter", clock.perf_counter)
        monkeypatch.setattr(steps.asyncio, "sleep", clock.sleep)
        t0 = clock.now
        for _ in range(100):
            await loop._step()
        busy = clock.now - t0
        # the engine goes idle (the loop waits for work), then work comes 5 s later
        loop.running.clear()
        idle = asyncio.ensure_future(loop.iterate())
        yielded = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(yielded.set_result, None)
        await yielded  # iterate() is now waiting for work
        clock.now += 5.0
        loop.running.append(req)
        loop.wake.set()
        await idle
        t1 = clock.now
        await loop._step()
        return busy, clock.now - t1

    busy, after_idle = asyncio.run(scenario())
    # 100 steps of 4 ms: each wake-up's lateness is made up by the next step instead of
    # adding up (100 × 4.8 ms = 480 ms when each step was timed from its own start)
    assert busy == pytest.approx(0.400 + clock.late, abs=1e-9)
    # an idle engine starts a new timeline: no credit for the time it waited
    assert after_idle == pytest.approx(0.004 + clock.late, abs=1e-9)


def test_after_a_stall_steps_make_up_at_most_the_catch_up_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop wakes 50 ms late once (a pause of the process, a busy core): the steps
    after it make up at most the catch-up cap (5 ms), the rest of the stall is not made
    up by running steps back to back, which would send a burst of tokens."""
    import asyncio

    from bidir_kv.engine import steps

    prof = CostProfile(
        "dec", decode_us_per_step=4000.0, kv_bytes_per_token=LAYERS * 4, num_layers=LAYERS
    )
    clock = _Clock(late=0.0)
    loop = _loop(prof, budget=64)
    req = _running(loop, "r", 16, 1, ignore_eos=True)
    req.blocks = list(range(1, 21))
    req.num_computed, req.max_tokens = 16, 10_000
    req.tokens.append(200)
    req.output.append(200)

    async def scenario() -> list[float]:
        monkeypatch.setattr(steps.time, "perf_counter", clock.perf_counter)
        monkeypatch.setattr(steps.asyncio, "sleep", clock.sleep)
        for _ in range(10):
            await loop._step()
        clock.now += 0.050  # the stall: the next step starts 50 ms after the last ended
        took = []
        for _ in range(10):
            t = clock.now
            await loop._step()
            took.append(clock.now - t)
        return took

    took = asyncio.run(scenario())
    # 10 steps of 4 ms less the 5 ms cap: the first step after the stall has no time
    # left to wait, the second waits 3 ms, then every step takes the profile's 4 ms
    assert sum(took) == pytest.approx(0.040 - 0.005, abs=1e-9)
    assert took[0] == pytest.approx(0.0, abs=1e-9)
    assert took[1] == pytest.approx(0.003, abs=1e-9)
    assert took[2:] == pytest.approx([0.004] * 8, abs=1e-9)
