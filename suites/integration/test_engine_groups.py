"""Several KV cache groups (a hybrid attention model) on the emulated engine.

``--kv-cache-groups full,sliding_window:W`` (docs/engine.md "KV cache groups"): every
group has its own blocks, sliding-window blocks outside the window are freed, D exports
one list per group and describes them (``bidir_kv_groups``). A rewritten history is cut
where every group allows (``policy.trim_groups``): the full group to the verified
prefix, the sliding group only if the blocks its window needs there are ones D still
holds. Every answer equals the engine's own recompute.

A sliding group can be cut only as far back as D still holds the window: a window
longer than the conversation (D freed nothing) anywhere, a shorter one only within
about a block of D's end (docs/protocol.md §6.4).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.client import scrape
from bidir_kv.policy import cdiv
from bidir_kv.testing.engines import EnginePair, random_prompt, sources
from bidir_kv.testing.router import (
    RouterProcess,
    chat,
    conversation_id,
    emulated_router_topology,
    long_opening,
    router_counter,
)
from bidir_kv.wire.params import GROUPS_KEY, groups_of

Factory = Callable[..., EnginePair]
BS = 16
LONG, WIDE, NARROW = 1024, 128, 24
MISMATCH = "bidir_kv:kv_verify_mismatched_blocks_total"
TOKENS = "vllm:prompt_tokens_by_source_total"


def _groups(window: int) -> tuple[str, ...]:
    return ("--kv-cache-groups", f"full,sliding_window:{window}")


def _pair(engine_pair: Factory, window: int, guard: str = "hashes") -> EnginePair:
    args = (*_groups(window), "--kv-guard", guard)
    return engine_pair(
        prefill={"enable_prefix_caching": False, "extra_args": args},
        decode={"extra_args": args},
    )


def _turn1(pair: EnginePair, seed: str) -> tuple[list[int], Any, random.Random]:
    rng = random.Random(seed)
    prompt = random_prompt(rng, 200)
    _, d1 = pair.turn(prompt, 48)
    assert d1 is not None and d1.ok and d1.params is not None, d1
    return prompt, d1, rng


def test_d_exports_every_group_and_a_verbatim_turn_reads_them_all(engine_pair: Factory) -> None:
    pair = _pair(engine_pair, NARROW)
    prompt, d1, rng = _turn1(pair, "verbatim")
    held = d1.params.remote_num_tokens  # 200 + 48 - 1
    full, window = d1.params.remote_block_ids
    assert len(full) == cdiv(held, BS) and len(window) == cdiv(NARROW, BS) + 1
    assert window[0] == 0 and 0 not in window[1:]  # the first exported entry was freed
    layout = groups_of(d1.params.extra)
    assert layout is not None and [g.window for g in layout] == [None, NARROW]
    prompt2 = [*prompt, *d1.token_ids, *random_prompt(rng, 30)]
    p0 = pair.p.metrics()
    pr = pair.p.complete(prompt2, 1, d1.params.for_prefill_hit())
    dp = pair.p.metrics() - p0
    assert pr.ok and pr.params is not None
    assert sources(dp)["external_kv_transfer"] == held and dp.value(MISMATCH) == 0
    assert GROUPS_KEY not in pr.params.extra  # only D describes its groups
    assert pair.d.complete(prompt2, 8, pr.params).token_ids == pair.p.complete(prompt2, 8).token_ids


@pytest.mark.parametrize(
    ("window", "edit_after", "reused"),
    [
        (LONG, 8, 208),  # the window spans the conversation: D holds it all
        (WIDE, 40, 240),  # the cut's window starts at block 7, D's first held one
        (WIDE, 24, 0),  # block 6 is needed: D freed it
        (NARROW, 40, 0),  # block 13 is needed: D holds from 14
    ],
)
def test_p_cuts_a_rewritten_history_where_every_group_allows(
    engine_pair: Factory, window: int, edit_after: int, reused: int
) -> None:
    """P given D's whole dict for a rewritten reply (as a router forwards it to a P that
    advertises verification) reads the verified prefix of the full group, and of the
    sliding group only what D still holds; else nothing. Equal to recompute.

    D computed 247 tokens (16 blocks); a window of W keeps blocks from
    ``(247 - W + 1) // 16`` (W = 128: 7; W = 24: 14); a cut at block k needs blocks
    ``k - cdiv(W - 1, 16)`` on."""
    pair = _pair(engine_pair, window)
    prompt, d1, rng = _turn1(pair, f"rewrite-{window}-{edit_after}")
    edited = [*d1.token_ids[:edit_after], *random_prompt(rng, 60)]
    prompt2 = [*prompt, *edited, *random_prompt(rng, 30)]
    mark = pair.p.log_mark()
    p0 = pair.p.metrics()
    pr = pair.p.complete(prompt2, 1, d1.params.for_prefill_hit())
    dp = pair.p.metrics() - p0
    assert pr.ok and pr.params is not None
    assert sources(dp)["external_kv_transfer"] == reused
    assert dp.value(MISMATCH) == 0
    if not reused:
        assert "not every KV cache group there (sliding-window-released)" in pair.p.log_since(mark)
    ref = pair.p.complete(prompt2, 8)
    assert pair.d.complete(prompt2, 8, pr.params).token_ids == ref.token_ids


def test_a_shorter_prompt_whose_window_d_freed_is_recomputed_not_failed(
    engine_pair: Factory,
) -> None:
    """A prompt that stops well before D's end (a regenerated or cut turn): D no longer
    holds its window, so P reads nothing and computes; under ``kv_load_failure_policy:
    fail`` that is an answer, not an error (refusing is a rule, not a failed read)."""
    args = (*_groups(NARROW), "--kv-guard", "hashes")
    pair = engine_pair(
        prefill={"enable_prefix_caching": False, "extra_args": args},
        decode={"extra_args": args},
        kv={"kv_load_failure_policy": "fail"},
    )
    prompt, d1, _ = _turn1(pair, "shorter")
    prompt2 = [*prompt, *d1.token_ids[:8]]  # 208 of D's 247 tokens
    p0 = pair.p.metrics()
    pr = pair.p.complete(prompt2, 1, d1.params.for_prefill_hit())
    dp = pair.p.metrics() - p0
    assert pr.ok and pr.params is not None, pr.error
    assert sources(dp)["external_kv_transfer"] == 0
    assert dp.value("vllm:nixl_num_failed_transfers_total") == 0
    ref = pair.p.complete(prompt2, 8)
    assert pair.d.complete(prompt2, 8, pr.params).token_ids == ref.token_ids


def test_without_the_guard_p_imports_other_tokens_kv(engine_pair: Factory) -> None:
    """Control: ``--kv-guard off`` (vLLM) reads D's whole history for the rewritten
    prompt, every group; the answer is then not the recompute's."""
    pair = _pair(engine_pair, WIDE, guard="off")
    prompt, d1, rng = _turn1(pair, "unguarded")
    prompt2 = [*prompt, *d1.token_ids[:8], *random_prompt(rng, 70)]
    p0 = pair.p.metrics()
    pr = pair.p.complete(prompt2, 1, d1.params.for_prefill_hit())
    dp = pair.p.metrics() - p0
    assert sources(dp)["external_kv_transfer"] == d1.params.remote_num_tokens
    assert dp.value(MISMATCH) > 0
    ref = pair.p.complete(prompt2, 8)
    assert pair.d.complete(prompt2, 8, pr.params).token_ids != ref.token_ids


# ---- through the router ---------------------------------------------------------------


@pytest.fixture(scope="module", params=[LONG, NARROW], ids=["long-window", "narrow-window"])
def hybrid(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """Hybrid P and D whose own guard is off (a stock P: the router must cut)."""
    window = request.param
    with emulated_router_topology(
        request.config,
        tmp_path_factory.mktemp(f"hybrid-{window}"),
        prefix_caching_on_p=False,
        engine_args=(*_groups(window), "--kv-guard", "off"),
    ) as topo:
        topo.window = window
        yield topo


def _router(topo: Any, router_process: Callable[..., RouterProcess], *flags: str) -> str:
    return router_process(
        [(n.host, n.port) for n in topo.prefill],
        [(n.host, n.port) for n in topo.decode],
        extra=("--block-size", str(BS), *flags),
    ).url


def _pulled(topo: Any, fn: Callable[[], Any]) -> tuple[Any, float]:
    before = scrape(topo.prefill[0].url)
    res = fn()
    delta = scrape(topo.prefill[0].url) - before
    return res, delta.value(TOKENS, source="external_kv_transfer")


def test_router_cuts_every_group_or_refuses_naming_the_window(
    hybrid: Any, router_process: Callable[..., RouterProcess], tmp_path: Path
) -> None:
    """Turn 2 replays turn 1's reply verbatim (all reused), then a rewritten one: a
    window longer than the conversation is cut with the full group, a narrow one is
    refused as ``sliding-window-released``. Every answer equals P's own recompute."""
    url = _router(hybrid, router_process)
    conv = conversation_id(f"hybrid-{hybrid.window}")
    msgs = long_opening(conv)
    first = chat(url, msgs, conv, max_tokens=40)
    assert first.status == 200

    def oracle(messages: list[dict[str, Any]]) -> str:
        return chat(hybrid.prefill[0].url, messages, stream=False, max_tokens=12).text

    verbatim = [
        *msgs,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Go on."},
    ]
    res, pulled = _pulled(hybrid, lambda: chat(url, verbatim, conv))
    assert res.status == 200 and res.text == oracle(verbatim) and pulled >= 64
    # the same conversation, the last reply rewritten: D holds turn 2 now
    kept = " ".join(res.text.split()[:1])
    rewritten = [
        *verbatim,
        {"role": "assistant", "content": kept + " and then, something else entirely."},
        {"role": "user", "content": "And after that?"},
    ]
    trims = router_counter(url, "guard_trims")
    refused = router_counter(url, "guard_rejections", reason="sliding-window-released")
    res, pulled = _pulled(hybrid, lambda: chat(url, rewritten, conv))
    assert res.status == 200 and res.text == oracle(rewritten)
    if hybrid.window == LONG:
        assert router_counter(url, "guard_trims") - trims == 1 and pulled >= 64
    else:
        assert (
            router_counter(url, "guard_rejections", reason="sliding-window-released") - refused == 1
        )
        assert pulled == 0
