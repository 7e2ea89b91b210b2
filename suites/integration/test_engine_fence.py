"""The fence and the retention budget on the emulated engine (docs/connector.md §5).

Real ``bidir-kv engine`` processes on loopback, over each transport. The fault
``release_on_claim`` makes D release a fenced turn and reuse its blocks while P's
READ of it is under way; P must see its fence word change, discard what it read and
recompute, so the answer equals a single engine's and nothing wrong is served.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.testing.engines import EnginePair, random_prompt, transport_names
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.topology.base import EngineSpec, TopologySpec
from bidir_kv.topology.local import LocalTopology
from bidir_kv.wire.fence import FENCE_KEY

Factory = Callable[..., EnginePair]
DISCARDED = "bidir_kv:fence_discarded_reads_total"
MISMATCH = "bidir_kv:kv_verify_mismatched_blocks_total"
EARLY = "bidir_kv:retained_released_early_reqs_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
PROMPT, GEN = 200, 8
# P without a prefix cache: every later turn reads D's whole history (as the oracle does)
COLD_P = {"enable_prefix_caching": False}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineClient]:
    """A single engine: the oracle every disaggregated answer must equal."""
    spec = TopologySpec(num_prefill=1, num_decode=0, routers=0, prefill=EngineSpec())
    with LocalTopology(spec, tmp_path_factory.mktemp("reference")) as topo:
        yield EngineClient(topo.prefill[0])


def _two_turns(pair: EnginePair, seed: str) -> tuple[list[int], Any]:
    """Turn 1 (D retains it) and turn 2's prompt: ``(prompt2, d1)``."""
    rng = random.Random(seed)
    prompt = random_prompt(rng, PROMPT)
    _, d1 = pair.turn(prompt, GEN)
    assert d1 is not None and d1.ok and d1.params is not None, d1
    return [*prompt, *d1.token_ids, *random_prompt(rng, 40)], d1


def _log(pair: EnginePair, which: str) -> str:
    node = pair.topo.prefill[0] if which == "p" else pair.topo.decode[0]
    return Path(node.log_path).read_text(errors="replace")


@pytest.mark.parametrize("transport", transport_names())
def test_release_during_read_is_discarded_and_recomputed(
    transport: str, engine_pair: Factory, reference: EngineClient
) -> None:
    pair = engine_pair(
        transport=transport, prefill=COLD_P, kv={"kv_load_failure_policy": "recompute"}
    )
    prompt2, d1 = _two_turns(pair, f"fence-{transport}")
    assert FENCE_KEY in d1.params.extra  # D exported a word: P's prefill advertised the fence
    pair.set_faults("d", release_on_claim=True)
    p0, _ = pair.snap()
    pr, dr = pair.turn(prompt2, GEN, d1.params)
    assert pr.ok and dr is not None and dr.ok, (pr.error, dr and dr.error)
    want = reference.complete(prompt2, GEN).raise_for_status()
    assert dr.token_ids == want.token_ids  # the answer equals the oracle's
    dp = pair.p.metrics() - p0
    assert dp.value(MISMATCH) == 0  # no block D reused made it into P's KV
    assert dp.value(DISCARDED) == 1  # the word changed during the read: discarded once
    assert dp.value(EXTERNAL_HITS) == 0  # P recomputed the history
    assert _log(pair, "p").count("Fence: engine") == 1  # logged once, with the ids
    # the fence does not cost an undisturbed read: the next turn reads D's history
    pair.set_faults("d", release_on_claim=False)
    p1, _ = pair.snap()
    prompt3 = [*prompt2, *dr.token_ids, 7, 8, 9]
    pr3, dr3 = pair.turn(prompt3, GEN, dr.params)
    assert pr3.ok and dr3 is not None and dr3.ok
    d = pair.p.metrics() - p1
    assert d.value(DISCARDED) == 0 and d.value(EXTERNAL_HITS) > 0 and d.value(MISMATCH) == 0
    assert dr3.token_ids == reference.complete(prompt3, GEN).raise_for_status().token_ids


def test_vllm_mode_speaks_no_fence(engine_pair: Factory) -> None:
    """``--retained-blocks pin`` (vLLM's behaviour): no advert from P, no word from D."""
    pin = {"extra_args": ("--retained-blocks", "pin")}
    pair = engine_pair(prefill=pin, decode=pin)
    rng = random.Random("pin-no-fence")
    pr, d1 = pair.turn(random_prompt(rng, PROMPT), GEN)
    assert pr.params is not None and FENCE_KEY not in pr.params.extra
    assert d1 is not None and d1.params is not None and FENCE_KEY not in d1.params.extra


def _retain(pair: EnginePair, seed: str, turns: int) -> list[Any]:
    rng = random.Random(seed)
    out = []
    for _ in range(turns):
        _, d = pair.turn(random_prompt(rng, PROMPT), GEN)
        assert d is not None and d.ok and d.params is not None
        out.append(d)
    return out


# 64 blocks of 16 tokens (63 usable); a 200-token turn retains 13 blocks
SMALL_KV = 1024


def test_budget_releases_the_oldest_fenced_turns(engine_pair: Factory) -> None:
    """Budget 0.5 of 63 blocks (31): each turn past the second pushes the oldest out,
    counted and logged with its id; P reading a released turn recomputes."""
    pair = engine_pair(
        decode={"kv_capacity_tokens": SMALL_KV}, decode_kv={"bidir_kv_retention_budget": 0.5}
    )
    _, d0 = pair.snap()
    turns = _retain(pair, "budget", 4)
    dd = pair.d.metrics() - d0
    assert dd.value(EARLY, reason="budget") == 2
    assert pair.state("d")["retained"] == 2
    log = _log(pair, "d")
    for d in turns[:2]:
        assert f"Releasing fenced retained turn {d.params.remote_request_id}" in log


def test_budget_never_releases_a_stock_readers_turn(engine_pair: Factory) -> None:
    """A P that does not speak the fence (``bidir_kv_fence: false``) advertises nothing,
    so D's turns stay unfenced and the budget leaves them to the TTL, as stock vLLM."""
    pair = engine_pair(
        decode={"kv_capacity_tokens": SMALL_KV},
        decode_kv={"bidir_kv_retention_budget": 0.5},
        prefill_kv={"bidir_kv_fence": False},
    )
    _, d0 = pair.snap()
    turns = _retain(pair, "stock-reader", 3)
    assert all(FENCE_KEY not in d.params.extra for d in turns)
    assert (pair.d.metrics() - d0).value(EARLY, reason="budget") == 0
    assert pair.state("d")["retained"] == 3
    assert _log(pair, "d").count("are not fenced (its dict does not advertise the fence)") == 1


def test_fenced_reader_reads_an_unfenced_owner_as_stock(engine_pair: Factory) -> None:
    """P speaks the fence, D does not (``bidir_kv_fence: false``): D exports no word, P
    reads D's history as vLLM does, says so once, and discards nothing."""
    pair = engine_pair(prefill=COLD_P, decode_kv={"bidir_kv_fence": False})
    rng = random.Random("unfenced-owner")
    p0, _ = pair.snap()
    prev = None
    prompt = random_prompt(rng, PROMPT)
    for _ in range(3):
        _, d = pair.turn(prompt, GEN, prev)
        assert d is not None and d.ok and d.params is not None
        assert FENCE_KEY not in d.params.extra
        prev, prompt = d.params, [*prompt, *d.token_ids, *random_prompt(rng, 20)]
    dp = pair.p.metrics() - p0
    assert dp.value(DISCARDED) == 0 and dp.value(EXTERNAL_HITS) > 0
    assert _log(pair, "p").count("exports no fence word we can read") == 1


@pytest.mark.parametrize("budget", [0, 1.5, "half"])
def test_bad_budget_is_one_log_line_and_stock_behaviour(
    engine_pair: Factory, budget: object
) -> None:
    pair = engine_pair(
        decode={"kv_capacity_tokens": SMALL_KV}, decode_kv={"bidir_kv_retention_budget": budget}
    )
    _, d0 = pair.snap()
    _retain(pair, f"bad-{budget}", 3)
    assert (pair.d.metrics() - d0).value(EARLY, reason="budget") == 0
    assert pair.state("d")["retained"] == 3
    assert _log(pair, "d").count("bidir_kv_retention_budget must be a share in (0, 1]") == 1
