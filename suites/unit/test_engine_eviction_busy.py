"""D under memory pressure while a P is reading one of its retained turns.

A retained turn a reader has claimed (its D->P READ is under way) is never taken
back for new work, even when it is the oldest: eviction gives up the other turns,
and when only busy ones are left it evicts nothing and the new work waits. The
owner is built from the engine's own in-process pieces (no server, no transport).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from bidir_kv.config import KVTransferConfig
from bidir_kv.engine.kvcache import BlockManager
from bidir_kv.engine.metrics import EngineMetrics
from bidir_kv.engine.owner import HandleOwner
from bidir_kv.engine.profiles import CostProfile
from bidir_kv.engine.settings import EngineSettings
from bidir_kv.engine.transport.base import KVPool

BS, LAYERS, NUM_BLOCKS = 16, 2, 13  # 12 usable blocks + the null block


def _owner() -> tuple[HandleOwner, BlockManager, list[float]]:
    profile = CostProfile("tiny", kv_bytes_per_token=LAYERS * 4, num_layers=LAYERS)
    kv = KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    settings = EngineSettings(model="m", served_names=["m"], kv=kv, profile=profile)
    blocks = BlockManager(
        KVPool.allocate(NUM_BLOCKS, BS * profile.kv_bytes_per_token),
        BS,
        LAYERS,
        enable_prefix_caching=False,
    )
    now = [0.0]
    # the owner asks its worker only for the clock and the fence table (none here)
    worker = cast(Any, SimpleNamespace(clock=lambda: now[0], fence=None))
    owner = HandleOwner(settings, blocks, worker, EngineMetrics("m"), wake=lambda: None)
    return owner, blocks, now


def _retain(owner: HandleOwner, blocks: BlockManager, rid: str, n: int, now: float) -> list[int]:
    held = blocks.allocate(n)
    owner.ledger.retain(rid, held, now)
    return held


def test_pressure_never_evicts_a_turn_whose_read_is_under_way() -> None:
    owner, blocks, now = _owner()
    oldest = _retain(owner, blocks, "oldest", 4, now=0.0)
    _retain(owner, blocks, "middle", 4, now=1.0)
    _retain(owner, blocks, "newest", 4, now=2.0)
    assert blocks.num_free == 0
    now[0] = 3.0
    # P claims the oldest turn: its READ of D's blocks is in flight
    assert owner.claim("oldest", oldest) is None
    # new work needs 8 blocks: oldest-first order would take "oldest"; it is busy
    evicted = owner.evict_for(8)
    assert evicted == 2 and blocks.num_free == 8
    assert "oldest" in owner.ledger and owner.ledger.blocks("oldest") == tuple(oldest)
    assert "middle" not in owner.ledger and "newest" not in owner.ledger
    # more pressure: only the busy turn is left, so nothing is evicted
    taken = blocks.allocate(8)
    assert owner.evict_for(4) == 0 and "oldest" in owner.ledger
    assert not set(oldest) & set(taken)  # the reader's blocks were never handed out
