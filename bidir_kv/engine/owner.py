"""The owning side of a transfer: blocks held for a peer, claims, notifications, expiry.

A finished request that a peer may read keeps its blocks here: D retains them in
the :class:`~bidir_kv.policy.RetentionLedger` until P's completion notification or
the TTL, P holds them under a :class:`~bidir_kv.policy.LeaseTable` lease that D's
heartbeats extend. Readers claim a handle once before reading it (our addition,
docs/engine.md), so a released or already-read handle is refused instead of
serving reused blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from bidir_kv.engine import notifications
from bidir_kv.engine.connector import ConnectorWorker
from bidir_kv.engine.faults import Faults
from bidir_kv.engine.groups import GroupTables
from bidir_kv.engine.kvcache import BlockManager
from bidir_kv.engine.metrics import EngineMetrics
from bidir_kv.engine.request import Request
from bidir_kv.engine.settings import EngineSettings
from bidir_kv.policy import (
    LeaseTable,
    RetentionLedger,
    blocks_for_tokens,
    heartbeat_extension,
    remote_deadline,
    retained_eviction_order,
    retention_budget_releases,
)
from bidir_kv.protocol import KVTransferParams
from bidir_kv.wire.fence import FENCE_KEY, advertises_fence, reader_advert, word_to_wire
from bidir_kv.wire.ids import EngineId, RequestId
from bidir_kv.wire.params import (
    GROUPS_KEY,
    LEASE_KEY,
    VERIFY_KEY,
    HeldTokens,
    groups_to_wire,
    lease_to_wire,
    verifier_advert,
)

__all__ = ["HandleOwner"]

logger = logging.getLogger("bidir_kv.engine")


class HandleOwner:
    """Retention ledger (D), leases (P), single-use claims and what each handle holds."""

    def __init__(
        self,
        settings: EngineSettings,
        blocks: BlockManager,
        worker: ConnectorWorker,
        metrics: EngineMetrics,
        *,
        wake: Callable[[], None],
        groups: GroupTables | None = None,
    ) -> None:
        self.settings = settings
        self.groups = groups  # the other KV cache groups (None: one full-attention group)
        self.kv = settings.kv
        self.faults: Faults = settings.faults
        self.blocks = blocks
        self.worker = worker
        self.metrics = metrics
        self.clock = worker.clock
        self._wake = wake
        self.ledger = RetentionLedger(ttl=self.kv.decoder_kv_blocks_ttl)
        self.leases = LeaseTable(duration=self.kv.kv_lease_duration)
        self._lease_blocks: dict[str, list[int]] = {}
        self._claimed: set[str] = set()
        # claimed request id -> the reader's engine id
        self._readers: dict[RequestId, EngineId] = {}
        self._handle_tokens: dict[RequestId, HeldTokens] = {}
        self._stock_readers: set[EngineId | None] = set()  # prefill engines without the advert

    # ---- holding -----------------------------------------------------------------------

    def release_or_retain(self, req: Request, reason: str) -> None:
        """A finished request's blocks: free them, or hold them for a peer's read."""
        bs = self.settings.block_size
        keep_n = blocks_for_tokens(req.num_computed, bs)
        keep, extra = req.blocks[:keep_n], req.blocks[keep_n:]
        self.blocks.free(extra)
        lists = [keep]
        if self.groups is not None:  # every group's list, and the blocks they hold
            lists, others = self.groups.finish(req, keep_n)
            keep = [*keep, *others]
        p = req.params
        ok = reason in ("stop", "length") and keep_n > 0 and p is not None
        if ok and (req.is_p_node or self.kv.bidirectional_kv_xfer):
            self._handle_tokens[req.request_id] = HeldTokens.of(
                req.tokens[: req.num_computed], bs, req.block_chain
            )
        if ok and req.is_p_node:
            self.leases.hold(req.request_id, self.clock())
            self._lease_blocks[req.request_id] = keep
            req.out_params = self._node_params(req, lists, prefill=True, expiry=None)
        elif ok and self.kv.bidirectional_kv_xfer:
            deadline = self.ledger.retain(req.request_id, keep, self.clock())
            expiry = remote_deadline(deadline, self.faults.clock_skew)
            req.out_params = self._node_params(req, lists, prefill=False, expiry=expiry)
            word = self._fence_word(req)
            if word is not None:
                req.out_params = KVTransferParams.build(
                    **{**req.out_params.to_dict(), FENCE_KEY: word_to_wire(*word)}
                )
            self._over_budget(req.request_id)
        else:
            self.blocks.free(keep)

    def _fence_word(self, req: Request) -> tuple[int, int] | None:
        """D's fence word for a turn whose reader advertised the fence (with P's dict,
        the params this request came with); ``None`` leaves the turn unfenced: it is
        then never released early for the budget."""
        fence = self.worker.fence
        if fence is None:
            return None
        if not advertises_fence(req.params.extra if req.params else None):
            reader = req.params.remote_engine_id if req.params else None
            if reader not in self._stock_readers:
                self._stock_readers.add(reader)
                logger.info(
                    "Fence: turns prefilled by engine %s are not fenced (its dict "
                    "does not advertise the fence); they are kept until its "
                    "notification or the TTL, as vLLM keeps them (logged once per "
                    "engine)",
                    reader,
                )
            return None
        return fence.export(req.request_id)

    def _node_params(
        self, req: Request, lists: list[list[int]], *, prefill: bool, expiry: float | None
    ) -> KVTransferParams:
        fields: dict[str, Any] = {
            "do_remote_prefill": prefill,
            "do_remote_decode": not prefill,
            "remote_block_ids": [list(g) for g in lists],
            "remote_engine_id": self.kv.engine_id,
            "remote_request_id": req.request_id,
            "remote_host": self.worker.side_host,
            "remote_port": self.worker.side_port,
            "tp_size": self.settings.tensor_parallel_size,  # vLLM: the owner's TP
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": req.num_computed,
            "remote_blocks_expiry_time": expiry,
        }
        if self.settings.emulate_vllm != "0.32":
            fields["remote_registration_generation"] = self.worker.generation
        fields["transfer_mode"] = "pull"
        if prefill:
            fields["remote_prefill_cached_tokens"] = req.cached_tokens
            if self.worker.fence is not None:  # D's reader will be us: we check the fence
                fields[FENCE_KEY] = reader_advert()
            if self.settings.kv_guard:  # and we read only what D's chain proves
                fields[VERIFY_KEY] = verifier_advert()
        else:
            if self.kv.conversation_lease is not None:  # as our vLLM connector's D does
                fields[LEASE_KEY] = lease_to_wire(self.kv.conversation_lease)
            if self.groups is not None:  # a router needs the layout to cut several lists
                fields[GROUPS_KEY] = groups_to_wire(self.groups.layout)
        return KVTransferParams.build(**fields)

    # ---- claims ------------------------------------------------------------------------

    def claim(
        self, request_id: RequestId, blocks: list[int], reader: EngineId | None = None
    ) -> str | None:
        """Grant single-use access to a held handle; return a refusal reason or None.

        After a grant, :meth:`handle_tokens` tells the reader what the handle holds;
        ``reader`` (its engine id) is remembered for :meth:`drop_reader`."""
        now = self.clock()
        if request_id in self._claimed:
            return f"request {request_id} was already read (handles are single use)"
        if request_id in self.ledger:
            if not self.ledger.is_readable(request_id, now):
                return f"retention of request {request_id} has expired"
            held = set(self.ledger.blocks(request_id) or ())
        elif request_id in self.leases:
            held = set(self._lease_blocks[request_id])
        else:
            return f"no blocks are held for request {request_id} (released or unknown)"
        foreign = [b for b in blocks if b not in held]
        if foreign:
            return f"blocks {foreign[:8]} are not held for request {request_id}"
        self._claimed.add(request_id)
        if reader is not None:
            self._readers[request_id] = reader
        if self.faults.release_on_claim and self._is_fenced(request_id):
            self._release_during_read(request_id)
        return None

    def _release_during_read(self, request_id: RequestId) -> None:
        """Fault ``release_on_claim``: D takes back a fenced turn while its reader's
        READ is under way, and reuses the blocks (new bytes) before the reader is done,
        which is exactly the race the fence exists for."""
        rel = self.ledger.evict(request_id)
        logger.warning(
            "fault release_on_claim: releasing fenced turn %s (%d blocks) during its read",
            request_id,
            len(rel.blocks),
        )
        self._release(request_id, list(rel.blocks))
        self.blocks.reuse_free(rel.blocks)  # the blocks' next owner writes them

    def handle_tokens(self, request_id: RequestId) -> HeldTokens | None:
        return self._handle_tokens.get(request_id)

    def _forget(self, request_id: RequestId) -> None:
        self._claimed.discard(request_id)
        self._readers.pop(request_id, None)
        self._handle_tokens.pop(request_id, None)

    def _is_fenced(self, request_id: RequestId) -> bool:
        """Whether the turn exported a fence word (its reader checks it): only such a
        turn is ever released before P's notification or the TTL, except under pressure."""
        fence = self.worker.fence
        return fence is not None and fence.is_fenced(request_id)

    def _release(self, request_id: str, blocks: list[int]) -> None:
        """Free a retained turn's blocks without its reader's notification: the fence
        word changes first, so a reader still reading them discards what it read."""
        fence = self.worker.fence
        if fence is not None:
            fence.bump(request_id)
        self._forget(request_id)
        self.blocks.free(blocks)

    def drop_reader(self, engine_id: str) -> int:
        """A peer is gone (``POST /drop_peer``): free every handle it claimed and will
        never report read; how many blocks were freed."""
        freed = 0
        for rid in [r for r, reader in self._readers.items() if reader == engine_id]:
            if rid in self.ledger:
                blocks = list(self.ledger.evict(rid).blocks)
            elif rid in self.leases:
                self.leases.release(rid)
                blocks = self._lease_blocks.pop(rid)
            else:
                blocks = []
            self._release(rid, blocks)  # a fenced turn's word changes and its slot is freed
            freed += len(blocks)
        if freed:
            self._wake()
        return freed

    # ---- notifications -----------------------------------------------------------------

    async def on_notification(self, peer: str, message: bytes) -> None:
        text = message.decode("utf-8", errors="replace")
        try:
            note = notifications.parse(text)
        except notifications.MalformedNotification:
            logger.warning("Ignoring malformed notification %r from %s", text, peer)
            return
        if isinstance(note, notifications.Heartbeat):
            self._heartbeat(note)
            return
        if self.faults.roll(self.faults.drop_notifications):
            logger.info("fault drop_notifications: ignoring notification %r", text)
            return
        self._completed(note)

    def _heartbeat(self, note: notifications.Heartbeat) -> None:
        for rid in self.leases.heartbeat(note.request_ids, self.clock()):
            logger.debug(
                "Heartbeat extended lease for request %s by %ds",
                rid,
                heartbeat_extension(self.kv.kv_lease_duration),
            )

    def _completed(self, note: notifications.ReadDone) -> None:
        rid = note.request_id
        if rid in self.ledger:
            rel = self.ledger.notify(rid, note.consumers)
            if rel is not None:
                if self.worker.fence is not None:
                    self.worker.fence.done(rid)  # the reader is done: the word stays
                self._forget(rid)
                self.blocks.free(rel.blocks)
        elif rid in self.leases:
            self.leases.release(rid)
            self._forget(rid)
            self.blocks.free(self._lease_blocks.pop(rid))
        else:
            logger.error(
                "Potentially invalid KV blocks for unrecognized request %s were retrieved by a "
                "decode worker. They may have expired.",
                rid,
            )
            self.metrics.notification_after_expiry()
            return
        self._wake()

    # ---- expiry ------------------------------------------------------------------------

    def reap(self, now: float) -> None:
        """Release every retention and lease whose deadline has passed."""
        for rel in self.ledger.reap(now):
            self._expire(rel.request_id, list(rel.blocks), rel.reads)
        for rid in self.leases.reap(now):
            self._expire(rid, self._lease_blocks.pop(rid), 0)

    def _expire(self, rid: RequestId, blocks: list[int], reads: int) -> None:
        logger.warning(
            "Releasing expired KV blocks for request %s which were retrieved by %d remote "
            "worker(s) before lease expired.",
            rid,
            reads,
        )
        self.metrics.expired()
        self._release(rid, blocks)
        self._wake()

    # ---- memory pressure ---------------------------------------------------------------

    def evict_for(self, need: int) -> int:
        """Give up retained turns (policy order) until ``need`` blocks are free.

        Only D's retained turns are candidates, never one being read (claimed) and
        never P's leases (a D is about to read those). Returns how many were evicted;
        ``retained_blocks="pin"`` (vLLM's behaviour) evicts nothing.
        """
        if self.settings.retained_blocks == "pin":
            return 0
        evicted = 0
        for rid in self._release_order():
            if self.blocks.num_free >= need:
                break
            fenced = self._is_fenced(rid)
            rel = self.ledger.evict(rid)
            logger.info(
                "Evicting retained KV blocks of request %s (%d blocks, %s) for new work",
                rid,
                len(rel.blocks),
                "fenced" if fenced else "unfenced, no read claimed",
            )
            self.metrics.evicted()
            if fenced:
                self.metrics.inc(self.metrics.released_early, reason="pressure")
            self._release(rid, list(rel.blocks))
            evicted += 1
        return evicted

    def _release_order(self, *, fenced_only: bool = False) -> list[str]:
        """Retained turns to give up: fenced ones oldest first, then (under pressure
        only) unfenced ones no reader has claimed (the emulator's claim protects a
        read of those; policy ``retained_eviction_order``)."""
        order = retained_eviction_order(self.ledger.deadlines(), busy=self._claimed)
        fenced = [rid for rid in order if self._is_fenced(rid)]
        if fenced_only:
            return fenced
        return fenced + [rid for rid in order if not self._is_fenced(rid)]

    def _over_budget(self, keep_id: str) -> None:
        """Release fenced retained turns, oldest first, until retained turns fit the
        retention budget (never ``keep_id``, the turn just retained; the rule is
        ``policy.retention_budget_releases``, shared with our vLLM connector)."""
        fence = self.worker.fence
        if fence is None or fence.budget is None:
            return
        held = {rid: self.ledger.blocks(rid) or () for rid in self.ledger.deadlines()}
        candidates = [rid for rid in self._release_order(fenced_only=True) if rid != keep_id]
        usable = self.blocks.num_usable_blocks
        for rid in retention_budget_releases(held, candidates, fence.budget, usable):
            rel = self.ledger.evict(rid)
            logger.info(
                "Releasing fenced retained turn %s (%d blocks): retained turns hold "
                "more than the retention budget (%.2f of %d blocks)",
                rid,
                len(rel.blocks),
                fence.budget,
                usable,
            )
            self.metrics.inc(self.metrics.released_early, reason="budget")
            self._release(rid, list(rel.blocks))

    def retained_share(self) -> float:
        """Share of usable blocks D's retained turns hold (``bidir_kv:kv_cache_retained_perc``)."""
        return self.ledger.held_blocks() / self.blocks.num_usable_blocks

    def held(self) -> dict[str, int]:
        """How many handles are retained (D) and leased (P)."""
        return {"retained": len(self.ledger), "leased": len(self.leases)}
