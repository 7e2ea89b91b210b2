"""The emulated engine's KV memory as vLLM V1 manages it: decode blocks taken one at a
time, recompute preemption when a running request cannot grow, retained turns taking
room from the running batch (docs/engine.md "Memory").

Why: retention on D holds KV memory; the decode-side cost it can have (preemptions,
hence TPOT) only shows on an engine that allocates as vLLM does. Before, the emulator
reserved a request's whole ``prompt + max_tokens - 1`` slots at admission and never
preempted, so retained turns could delay admission but never a running decode.

The step loop runs with a zero-cost profile: no time passes, the order of steps is
the same on any machine, so every count below is deterministic.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from bidir_kv.config import KVTransferConfig
from bidir_kv.engine.compute import ModelRunner
from bidir_kv.engine.groups import GroupTables, parse_groups
from bidir_kv.engine.kvcache import BlockManager
from bidir_kv.engine.metrics import EngineMetrics
from bidir_kv.engine.profiles import CostProfile
from bidir_kv.engine.request import Request
from bidir_kv.engine.settings import EngineSettings
from bidir_kv.engine.steps import StepLoop
from bidir_kv.engine.transport.base import KVPool
from bidir_kv.policy import blocks_for_tokens

BS, LAYERS = 16, 2
PROFILE = CostProfile("zero", kv_bytes_per_token=LAYERS * 8, num_layers=LAYERS)


class _Reader:
    """Every request computes locally (no transfer in these tests)."""

    num_pulling = 0

    def begin(self, req: Request, hit: int) -> bool:
        return False


class _Owner:
    """What a finished request's blocks become: freed (OFF, or a P), or kept for a peer
    as D's retained turns are (ON: the ids in ``retain``), pinned as vLLM pins them."""

    def __init__(self, blocks: BlockManager, retain: frozenset[str]) -> None:
        self.blocks, self.retain = blocks, retain
        self.retained: list[list[int]] = []

    def release_or_retain(self, req: Request, reason: str) -> None:
        keep_n = blocks_for_tokens(req.num_computed, BS)
        keep, extra = req.blocks[:keep_n], req.blocks[keep_n:]
        self.blocks.free(extra)
        for table in req.group_blocks.values():  # the other KV cache groups: freed
            self.blocks.free([b for b in table if b != 0])
        req.group_blocks = {}
        if req.request_id in self.retain and reason in ("stop", "length"):
            self.retained.append(keep)
        else:
            self.blocks.free(keep)

    def evict_for(self, need: int) -> int:
        return 0  # pinned

    def held(self) -> dict[str, int]:
        return {"retained": len(self.retained), "leased": 0}


def _loop(
    usable_blocks: int, retain: frozenset[str] = frozenset(), groups: str = "full"
) -> tuple[StepLoop, EngineMetrics]:
    settings = EngineSettings(
        model="m",
        served_names=["m"],
        kv=KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_both"}),
        profile=PROFILE,
        max_num_batched_tokens=4096,
        max_waiting_seconds=0,
    )
    layout = parse_groups(groups, BS)
    n = len(layout)
    pool = KVPool.allocate(usable_blocks + 1, BS * PROFILE.kv_bytes_per_token // n)
    blocks = BlockManager(pool, BS, LAYERS // n, enable_prefix_caching=n == 1)
    metrics = EngineMetrics("m")
    owner = _Owner(blocks, retain)
    tables = GroupTables(layout, blocks) if n > 1 else None
    loop = StepLoop(
        settings,
        blocks,
        ModelRunner(blocks, tables),
        metrics,
        reader=cast(Any, _Reader()),
        owner=cast(Any, owner),
    )
    return loop, metrics


def _request(rid: str, prompt_tokens: int, max_tokens: int, first: int = 300) -> Request:
    prompt = [first + (i * 7) % 500 for i in range(prompt_tokens)]
    return Request(rid, prompt, max_tokens, ignore_eos=True)


async def _drain(loop: StepLoop, reqs: list[Request], max_iterations: int = 5000) -> None:
    """Iterate the loop until ``reqs`` finish. No time passes in a step here, so an
    iteration that does not return at once is a loop waiting for work that never comes
    (a request that can never be admitted): that fails instead of hanging."""
    for _ in range(max_iterations):
        if all(r.state == "finished" for r in reqs):
            return
        try:
            await asyncio.wait_for(loop.iterate(), 10.0)
        except TimeoutError:
            raise AssertionError(
                f"the loop waits for work: {[(r.request_id, r.state) for r in reqs]}"
            ) from None
    raise AssertionError(f"requests did not finish: {[(r.request_id, r.state) for r in reqs]}")


def _preemptions(metrics: EngineMetrics) -> float:
    return metrics.preemptions.labels(**metrics.labels)._value.get()


def _run(usable: int, plan: list[tuple[str, int, int]], groups: str = "full") -> dict[str, Any]:
    """Submit ``plan`` (id, prompt tokens, max tokens) at once and run it to the end; a
    request's prompt depends only on its id."""
    loop, metrics = _loop(usable, groups=groups)
    reqs = [_request(rid, n, m, first=300 + ord(rid[0])) for rid, n, m in plan]

    async def go() -> None:
        for r in reqs:
            loop.submit(r)
        await _drain(loop, reqs)

    asyncio.run(go())
    return {
        "outputs": {r.request_id: list(r.output) for r in reqs},
        "preemptions": _preemptions(metrics),
        "per_request": {r.request_id: r.num_preemptions for r in reqs},
        "free": loop.blocks.num_free,
    }


def test_admission_takes_the_prompt_blocks_and_decode_grows_a_block_at_a_time() -> None:
    loop, _ = _loop(64)
    req = _request("a", 20, 40)

    async def go() -> list[int]:
        loop.submit(req)
        sizes = []
        while req.state != "finished":
            await loop.iterate()
            if req.state == "running":
                sizes.append(len(req.blocks))
        return sizes

    sizes = asyncio.run(go())
    assert sizes[0] == blocks_for_tokens(20, BS)  # 2 blocks, not the 4 of 20 + 40 - 1 slots
    assert sorted(set(sizes)) == [2, 3, 4]  # a new block at slots 32 and 48
    assert max(sizes) == blocks_for_tokens(20 + 40 - 1, BS)


def test_a_request_that_cannot_grow_preempts_the_latest_and_both_finish_unchanged() -> None:
    plan = [("a", 40, 60), ("b", 40, 60)]  # 7 blocks each at the end; 10 fit
    alone = {rid: _run(64, [(rid, n, m)])["outputs"][rid] for rid, n, m in plan}
    squeezed = _run(10, plan)
    assert squeezed["preemptions"] >= 1
    assert squeezed["per_request"]["a"] == 0  # the earlier request is never the victim
    assert squeezed["per_request"]["b"] >= 1
    # recomputed KV is the same KV: every answer is what the request gets alone
    assert squeezed["outputs"] == alone
    assert squeezed["free"] == 10  # nothing left allocated
    roomy = _run(64, plan)
    assert roomy["preemptions"] == 0 and roomy["outputs"] == alone


def test_retained_turns_take_room_from_the_running_batch() -> None:
    """The same requests, one after the other, then two at once: with finished turns
    retained (ON) the two concurrent decodes no longer fit and one is preempted; with
    finished turns freed (OFF) nothing is. 18 blocks: the pair needs 14 at its end, the
    two retained turns hold 6."""
    warm = [("w1", 40, 8), ("w2", 40, 8)]
    pair = [("a", 40, 60), ("b", 40, 60)]

    def run(retain: bool) -> tuple[float, dict[str, list[int]]]:
        loop, metrics = _loop(18, frozenset({"w1", "w2"}) if retain else frozenset())

        async def go() -> dict[str, list[int]]:
            for rid, n, m in warm:
                r = _request(rid, n, m, first=100 + ord(rid[1]))
                loop.submit(r)
                await _drain(loop, [r])
            reqs = [_request(rid, n, m, first=300 + ord(rid[0])) for rid, n, m in pair]
            for r in reqs:
                loop.submit(r)
            await _drain(loop, reqs)
            return {r.request_id: list(r.output) for r in reqs}

        outputs = asyncio.run(go())
        return _preemptions(metrics), outputs

    off, off_out = run(retain=False)
    on, on_out = run(retain=True)
    assert off == 0
    assert on > off
    assert on_out == off_out


def test_a_preempted_request_waits_without_the_queue_bound() -> None:
    loop, _ = _loop(10)
    loop.settings.max_waiting_seconds = 1.0
    req = _request("p", 40, 60)
    req.num_preemptions = 1
    req.arrival -= 100.0
    loop.waiting.append(req)
    assert loop.expire_waiting(req.arrival + 100.0) == 0
    fresh = _request("q", 40, 60)
    fresh.arrival -= 100.0
    loop.waiting.append(fresh)
    assert loop.expire_waiting(fresh.arrival + 100.0) == 1
    assert fresh.error is not None and fresh.error.http_status == 503


@pytest.mark.parametrize("usable", [8, 9, 12])
def test_preemption_never_leaks_blocks(usable: int) -> None:
    plan = [("a", 30, 50), ("b", 20, 70), ("c", 50, 30)]
    out = _run(usable, plan)
    assert out["free"] == usable


def test_preemption_with_a_sliding_window_group_frees_every_table() -> None:
    """Two KV cache groups (engine/groups.py): growth takes a block in each table,
    a preemption frees both, and the answers equal those of a roomy pool."""
    plan = [("a", 40, 60), ("b", 40, 60)]
    hybrid = "full,sliding_window:32"
    roomy = _run(128, plan, groups=hybrid)
    squeezed = _run(16, plan, groups=hybrid)
    assert roomy["preemptions"] == 0
    assert squeezed["preemptions"] >= 1
    assert squeezed["outputs"] == roomy["outputs"]
    assert squeezed["free"] == 16
