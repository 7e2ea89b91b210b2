"""The greedy-equivalence oracle (issue 5, item 4).

Many random multi-turn conversations, token-id prompts, ``temperature 0``: every
answer through P/D -- with D->P pulls engaged -- must equal the answer of a
non-disaggregated run that reuses no cached KV. Run directly (scenario drives P and
D itself) and through a router: ours (``bidir-kv proxy``; ``--decode-stream never`` for
vLLM 0.32, which has no params on streams) and any given with ``--proxy-cmd`` or
``--proxy-url`` (the ``router`` fixture of :mod:`bidir_kv.testing.conformance`).
Engagement is proven with metric deltas (tokens from ``external_kv_transfer`` and NIXL
bytes on P), never with timings.

The through-router variant also covers a non-continuation turn (stripped reasoning):
with the router's continuation guard it must equal recompute as well.
"""

from __future__ import annotations

import os
import random

import pytest

from bidir_kv.client import COMPLETIONS_PATH, fetch, get_json, run_pd_turn
from bidir_kv.protocol import KVTransferParams
from bidir_kv.testing.backends import PDBackend, PromptFactory
from bidir_kv.testing.scenario import evidence

CONVERSATIONS = int(os.environ.get("BIDIR_KV_ORACLE_CONVERSATIONS", "4"))
TURNS = 3


def _plan(rng: random.Random, bs: int) -> list[tuple[int, int]]:
    """(new tokens, generated tokens) per turn; lengths vary across block boundaries."""
    return [(rng.randrange(bs // 2, 5 * bs), rng.randrange(8, 80)) for _ in range(TURNS)]


@pytest.mark.timeout(1800)  # a P variant or many turns on a loaded 2-core box
def test_oracle_direct(pd: PDBackend, prompts: PromptFactory) -> None:
    rng = random.Random(f"oracle-direct-{pd.block_size}")
    turns = pulls = 0
    mismatches: list[str] = []
    done: list[tuple[str, list[int], int, list[int]]] = []
    for conv in range(CONVERSATIONS):
        history: list[int] = []
        prev: KVTransferParams | None = None
        for turn, (new, gen) in enumerate(_plan(rng, pd.block_size)):
            prompt = [*history, *prompts.tokens(new)]
            t = run_pd_turn(pd.prefill, pd.decode, prompt, gen, prev)
            assert t.p.ok and t.d is not None and t.d.ok, (
                f"conversation {conv} turn {turn} failed: {t.p.error or t.d}"
            )
            ev = evidence(t.p_leg.p)
            if turn > 0:
                turns += 1
                pulls += int(ev.pulled)
            done.append(
                (f"conv {conv} turn {turn} (pulled {ev.external})", prompt, gen, t.d.token_ids)
            )
            history, prev = t.sequence, t.d.params
        # references after the conversation: keep the gap between turns short (D's TTL)
        for label, prompt, gen, got in done:
            if got != pd.reference(prompt, gen).token_ids:
                mismatches.append(label)
        done.clear()
    assert not mismatches, f"P/D output differs from recompute: {mismatches}"
    assert pulls >= turns // 2, f"pulls engaged on only {pulls} of {turns} later turns"


# ---- through a router (ours, and --proxy-cmd / --proxy-url when given) -----------------


def _ask(url: str, conv: str, prompt: list[int], gen: int) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": gen,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "conversation_id": conv,
    }
    reply = fetch(
        url + COMPLETIONS_PATH,
        method="POST",
        json=body,
        headers={"X-Session-ID": conv},
        timeout=120,
    )
    out = reply.raise_for_status().json_object()
    choice = out["choices"][0]
    assert "kv_transfer_params" not in out or out["kv_transfer_params"] is None
    ids = choice.get("token_ids")
    assert ids is not None, f"router dropped token_ids: {sorted(choice)}"
    return [int(t) for t in ids]


@pytest.mark.timeout(1800)  # a P variant or many turns on a loaded 2-core box
def test_oracle_through_router(
    pd: PDBackend, prompts: PromptFactory, router: str, proxy: str
) -> None:
    rng = random.Random(f"oracle-router-{pd.block_size}")
    turns = 0
    mismatches: list[str] = []
    done: list[tuple[str, list[int], int, list[int]]] = []
    p_before = pd.prefill.metrics()
    for conv in range(CONVERSATIONS):
        cid = f"conf-{prompts.tag}-{conv}"
        history: list[int] = []
        for turn, (new, gen) in enumerate(_plan(rng, pd.block_size)):
            prompt = [*history, *prompts.tokens(new)]
            out = _ask(router, cid, prompt, gen)
            done.append((f"conv {conv} turn {turn}", prompt, gen, out))
            turns += int(turn > 0)
            if turn == TURNS - 2 and conv % 2 == 1:
                # the client strips the first half of the answer ("reasoning")
                out = out[len(out) // 2 :]
            history = [*prompt, *out]
        for label, ref_prompt, ref_gen, got in done:
            if got != pd.reference(ref_prompt, ref_gen).token_ids:
                mismatches.append(label)
        done.clear()
    ev = evidence(pd.prefill.metrics() - p_before)
    assert not mismatches, f"output through the router differs from recompute: {mismatches}"
    assert ev.external > 0 and ev.bytes > 0, f"no D->P pull engaged through the router: {ev}"
    if proxy == "bidir-kv":  # started without --block-size: each node's own figure
        health = get_json(router + "/health")
        learned = {n["block_size"] for role in ("prefill", "decode") for n in health[role]}
        assert learned == {pd.block_size}, f"block sizes learned from the nodes: {health}"
