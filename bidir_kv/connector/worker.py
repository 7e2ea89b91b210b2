"""The worker side: vLLM's NIXL pull worker, plus the fence, plus a handshake again
with a peer whose read failed.

*Restarted peers.* vLLM 0.32 keeps a remote engine's NIXL agent until that engine id
is replaced at its address or its metadata is gone locally. A peer restarted with the
same engine id (a deploy, a crash and restart) matches neither: the reader keeps the
dead agent and every later read from that peer fails (docs/connector.md §3.4). Here a
failed read marks the engine invalid, and vLLM's own invalid-peer path does the rest:
it releases the engine once its reads drain (a repeat within its backoff waits
longer), and the next read handshakes afresh. A declined read is not a failure here
(vLLM records it as an expiry), so it does not invalidate the engine.

*The fence* (docs/connector.md §5), held in one :class:`WorkerFence`. D: a table of
64-bit words registered with NIXL before the handshake metadata is built; the
scheduler's :class:`~bidir_kv.connector.fence.FenceMeta` (in :class:`BidirKVMetadata`)
says which words to write (turns it exported) and which turns to release early, and
this worker bumps a turn's word before vLLM may free its blocks (released turns, and
turns reaped at the TTL). P: when a readback's block READ is done, one 8-byte READ of
D's word into a scratch word; a changed word turns the read into a failed load, which
``kv_load_failure_policy: recompute`` recomputes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from collections import deque
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlConnectorMetadata,
    NixlPullConnectorWorker,
)

from bidir_kv.connector.fence import FenceMeta, WordCheck
from bidir_kv.wire.fence import FENCE_SLOTS, bumped

__all__ = ["FENCE_BASE_ATTR", "BidirKVMetadata", "BidirKVWorker", "WorkerFence"]

log = logging.getLogger("vllm.bidir_kv.connector")
_SCRATCH = 64  # word READs in flight at once
_MEM = "DRAM"
# The attribute of vLLM's handshake payload object that carries our word table's address
# to our scheduler (None: not registered). An attribute, not a field: msgspec serves only
# the payload's fields, so the wire stays vLLM's.
FENCE_BASE_ATTR = "bidir_fence_base"


class BidirKVMetadata(NixlConnectorMetadata):
    """vLLM's connector metadata for one step, plus our scheduler's fence orders (typed,
    as vLLM's own ``ReqMeta`` are)."""

    def __init__(self, base: NixlConnectorMetadata, fence: FenceMeta) -> None:
        super().__init__()
        self.__dict__.update(base.__dict__)  # every field vLLM's scheduler filled in, as built
        self.fence = fence


class WorkerFence:
    """The worker's side of the fence: D's registered words and the turns they guard,
    P's scratch words and its word READs in flight."""

    def __init__(self, words: np.ndarray, scratch: np.ndarray, scratch_dlist: Any) -> None:
        self.words = words
        self.scratch = scratch
        self.scratch_dlist = scratch_dlist  # prepared once: READs land in scratch[i]
        self.scratch_free: deque[int] = deque(range(len(scratch)))
        self.slots: dict[str, int] = {}  # D: exported turn -> its word
        self.released: set[str] = set()  # D: released early, to report once as sent
        self.checks: dict[str, WordCheck] = {}  # P: readback -> D's word to check
        self.reads: dict[str, tuple[Any, int, WordCheck]] = {}  # P: word READs in flight
        self.remote: dict[tuple[str, int], Any] = {}  # P: D's prepared words

    @property
    def base(self) -> int:
        return int(self.words.ctypes.data)

    def write(self, writes: FenceMeta) -> None:
        """D: the words of turns the scheduler exported (before this step's forward pass)."""
        for rid, (slot, gen) in writes.writes.items():
            self.words[slot] = np.uint64(gen)
            self.slots[rid] = slot

    def bump(self, rid: str) -> None:
        """D: the turn's blocks may be reused from now on: change its word first."""
        slot = self.slots.pop(rid, None)
        if slot is not None:
            self.words[slot] = np.uint64(bumped(int(self.words[slot])))


class BidirKVWorker(NixlPullConnectorWorker):
    """Adds behaviour only: :class:`~bidir_kv.connector.nixl.BidirKVConnector`
    re-classes the worker vLLM built rather than build a second NIXL agent, so no
    ``__init__`` of ours runs: the fence is created in :meth:`register_kv_caches`, and
    until then (or when its words cannot be registered) it is the class's ``None``."""

    fence: WorkerFence | None = None
    num_fence_discarded = 0

    # ---- restarted peers ---------------------------------------------------------------

    def _cleanup_remote_engines(self) -> None:
        now = time.perf_counter()
        for engine_id in self._failed_remote_engines - self._invalid_remote_engines:
            if engine_id in self._remote_agents:
                self._mark_remote_engine_invalid(engine_id, now)
        super()._cleanup_remote_engines()

    # ---- the fence: registration -------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> None:
        self.fence = self._register_fence()
        super().register_kv_caches(kv_caches)
        md = self.xfer_handshake_metadata
        if md is not None:  # read by our scheduler; msgspec serves vLLM's fields only
            setattr(md, FENCE_BASE_ATTR, self.fence.base if self.fence is not None else None)

    def _register_fence(self) -> WorkerFence | None:
        words = np.zeros(FENCE_SLOTS, dtype=np.uint64)
        scratch = np.zeros(_SCRATCH, dtype=np.uint64)
        try:
            descs = self.nixl_wrapper.get_reg_descs(
                [
                    (words.ctypes.data, words.nbytes, 0, ""),
                    (scratch.ctypes.data, scratch.nbytes, 0, ""),
                ],
                _MEM,
            )
            self.nixl_wrapper.register_memory(descs, backends=self.nixl_backends)
            self._registered_descs.append(descs)  # vLLM deregisters them at shutdown
            local = self.nixl_wrapper.get_xfer_descs(
                [(scratch.ctypes.data + 8 * i, 8, 0) for i in range(_SCRATCH)], _MEM
            )
            dlist = self.nixl_wrapper.prep_xfer_dlist("NIXL_INIT_AGENT", local)
        except Exception as exc:
            log.warning(
                "bidir-kv: the fence words could not be registered with NIXL (%s); "
                "running without the fence (stock behaviour).",
                exc,
            )
            return None
        return WorkerFence(words, scratch, dlist)

    # ---- the fence: D ------------------------------------------------------------------

    def start_load_kv(self, metadata: Any) -> None:
        super().start_load_kv(metadata)
        # runs before this step's forward pass: a word written here is in memory before
        # any block freed after this step is written again
        fence = self.fence
        if fence is None or not isinstance(metadata, BidirKVMetadata):
            return
        orders = metadata.fence
        fence.write(orders)
        for rid in orders.release:
            held = rid in self._reqs_to_send or rid in self._reqs_to_process
            fence.bump(rid)
            if rid in orders.scribble:  # fault injection: the blocks' next owner writes them
                log.warning(
                    "bidir-kv: fault: released turn %s and overwrote %d block region(s).",
                    rid,
                    self._bidir_scribble(orders.scribble[rid]),
                )
            if held:  # not already notified or reaped: report it once, as sent
                self._reqs_to_send.pop(rid, None)
                self._reqs_to_process.discard(rid)
                fence.released.add(rid)
        fence.checks.update(orders.checks)

    def _bidir_scribble(self, block_ids: tuple[int, ...]) -> int:
        """Overwrite ``block_ids`` in every host-memory KV region, the byte ranges a
        peer's READ of them covers (fault injection only)."""
        if self._physical_blocks_per_logical_kv_block != 1:
            return 0
        bases = self.kv_caches_base_addr[self.engine_id][self.tp_rank]
        done = 0
        for i, base in enumerate(bases):
            if self.region_mem_types[i] != _MEM:
                continue
            stride, length = self.block_stride_per_layer[i], self.block_len_per_layer[i]
            for b in block_ids:
                if 0 <= b < self.region_num_blocks[i]:
                    ctypes.memset(base + b * stride, 0x5A, length)
                    done += 1
        return done

    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        before = set(self._reqs_to_send)
        super()._reap_expired_send_leases(done_sending)
        if self.fence is not None:
            for rid in before - set(self._reqs_to_send):
                self.fence.bump(rid)  # expired: freed without P's notification

    def get_transfer_results(self) -> Any:
        results = super().get_transfer_results()
        fence = self.fence
        if fence is not None:
            results.finished_sending.update(fence.released)
            fence.released.clear()
            for rid in results.finished_sending:  # notified: the word keeps its value
                fence.slots.pop(rid, None)
        return results

    # ---- the fence: P ------------------------------------------------------------------

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        done, failed = super()._pop_done_transfers(transfers)
        fence = self.fence
        if (
            fence is None
            or transfers is not self._recving_transfers
            or (not fence.checks and not fence.reads)
        ):
            return done, failed
        for rid in failed:
            fence.checks.pop(rid, None)
        for rid in list(done):
            check = fence.checks.pop(rid, None)
            if check is None:
                continue
            done.discard(rid)  # reported once its word is read
            if not self._bidir_post(fence, rid, check):
                self._bidir_discard(rid, check.engine, "its fence word could not be read")
                failed.add(rid)
        for rid, (handle, idx, check) in list(fence.reads.items()):
            try:
                state = self.nixl_wrapper.check_xfer_state(handle)
            except Exception:
                state = "ERR"
            if state == "PROC":
                continue
            del fence.reads[rid]
            value = int(fence.scratch[idx]) if state == "DONE" else None
            with contextlib.suppress(Exception):
                self.nixl_wrapper.release_xfer_handle(handle)
            fence.scratch_free.append(idx)
            if value == check.gen:
                done.add(rid)
            else:
                why = (
                    f"its fence word changed during the read ({check.gen} -> {value})"
                    if value is not None
                    else f"its fence word READ ended in {state}"
                )
                self._bidir_discard(rid, check.engine, why)
                failed.add(rid)
        return done, failed

    def _bidir_post(self, fence: WorkerFence, rid: str, check: WordCheck) -> bool:
        agents = self._remote_agents.get(check.engine) or {}
        name = agents.get((0, 0)) or next(iter(agents.values()), None)
        if name is None or not fence.scratch_free or not 0 <= check.slot < FENCE_SLOTS:
            return False
        try:
            remote = fence.remote.get((check.engine, check.base))
            if remote is None:
                descs = self.nixl_wrapper.get_xfer_descs(
                    [(check.base + 8 * i, 8, 0) for i in range(FENCE_SLOTS)], _MEM
                )
                remote = self.nixl_wrapper.prep_xfer_dlist(name, descs)
                fence.remote[(check.engine, check.base)] = remote
            idx = fence.scratch_free.popleft()
            fence.scratch[idx] = 0
            handle = self.nixl_wrapper.make_prepped_xfer(
                "READ", fence.scratch_dlist, [idx], remote, [check.slot]
            )
            self.nixl_wrapper.transfer(handle)
        except Exception as exc:
            log.warning(
                "bidir-kv: fence word READ of engine %s failed to post: %s", check.engine, exc
            )
            return False
        fence.reads[rid] = (handle, idx, check)
        return True

    def _bidir_discard(self, rid: str, engine: str, why: str) -> None:
        self.num_fence_discarded += 1
        log.warning(
            "bidir-kv: fence: engine %s may have released the blocks request %s "
            "read: %s; discarding the read (recomputed under kv_load_failure_policy "
            "recompute).",
            engine,
            rid,
            why,
        )
