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

*The fence* (docs/connector.md §5). D: a table of 64-bit words registered with NIXL
before the handshake metadata is built; the scheduler's metadata says which words to
write (turns it exported) and which turns to release early, and this worker bumps a
turn's word before vLLM may free its blocks (released turns, and turns reaped at the
TTL). P: when a readback's block READ is done, one 8-byte READ of D's word into a
scratch word; a changed word turns the read into a failed load, which
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
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker

from bidir_kv.connector.retention import BUMP_BIT, FENCE_SLOTS

__all__ = ["BidirKVWorker"]

log = logging.getLogger("vllm.bidir_kv.connector")
_SCRATCH = 64  # word READs in flight at once
_MEM = "DRAM"


class BidirKVWorker(NixlPullConnectorWorker):
    """Adds behaviour only: :class:`~bidir_kv.connector.nixl.BidirKVConnector`
    re-classes the worker vLLM built rather than build a second NIXL agent, so the
    fence's state is created in :meth:`register_kv_caches` (``_bidir_*`` attributes)."""

    # ---- restarted peers ---------------------------------------------------------------

    def _cleanup_remote_engines(self) -> None:
        now = time.perf_counter()
        for engine_id in self._failed_remote_engines - self._invalid_remote_engines:
            if engine_id in self._remote_agents:
                self._mark_remote_engine_invalid(engine_id, now)
        super()._cleanup_remote_engines()

    # ---- the fence: registration -------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> None:
        self._bidir_setup()
        super().register_kv_caches(kv_caches)
        md = self.xfer_handshake_metadata
        if md is not None:  # read by our scheduler; msgspec serves vLLM's fields only
            words = self._bidir_words
            md.bidir_fence_ok = words is not None
            md.bidir_fence_base = int(words.ctypes.data) if words is not None else None

    def _bidir_setup(self) -> None:
        self._bidir_words: np.ndarray | None = None
        self._bidir_scratch = np.zeros(_SCRATCH, dtype=np.uint64)
        self._bidir_scratch_free: deque[int] = deque(range(_SCRATCH))
        self._bidir_scratch_dlist: Any = None
        self._bidir_slots: dict[str, int] = {}  # D: exported turn -> its word
        self._bidir_released: set[str] = set()  # D: released early, to report as sent
        self._bidir_checks: dict[str, tuple[int, int, int, str]] = {}  # P: rid -> word
        self._bidir_reads: dict[str, tuple[Any, int, int, str]] = {}  # P: word READs
        self._bidir_remote: dict[tuple[str, int], Any] = {}  # P: D's prepared words
        self.num_fence_discarded = 0
        words = np.zeros(FENCE_SLOTS, dtype=np.uint64)
        scratch = self._bidir_scratch
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
            self._bidir_scratch_dlist = self.nixl_wrapper.prep_xfer_dlist("NIXL_INIT_AGENT", local)
        except Exception as exc:
            log.warning(
                "bidir-kv: the fence words could not be registered with NIXL (%s); "
                "running without the fence (stock behaviour).",
                exc,
            )
            return
        self._bidir_words = words

    # ---- the fence: D ------------------------------------------------------------------

    def start_load_kv(self, metadata: Any) -> None:
        super().start_load_kv(metadata)
        # runs before this step's forward pass: a word written here is in memory before
        # any block freed after this step is written again
        words = getattr(self, "_bidir_words", None)
        if words is None:
            return
        for rid, (slot, gen) in getattr(metadata, "bidir_fence_writes", {}).items():
            words[slot] = np.uint64(gen)
            self._bidir_slots[rid] = slot
        scribble = getattr(metadata, "bidir_fence_scribble", {})
        for rid in getattr(metadata, "bidir_fence_release", ()):
            held = rid in self._reqs_to_send or rid in self._reqs_to_process
            self._bidir_bump(rid)
            if rid in scribble:  # fault injection: the blocks' next owner writes them
                log.warning(
                    "bidir-kv: fault: released turn %s and overwrote %d block region(s).",
                    rid,
                    self._bidir_scribble(scribble[rid]),
                )
            if held:  # not already notified or reaped: report it once, as sent
                self._reqs_to_send.pop(rid, None)
                self._reqs_to_process.discard(rid)
                self._bidir_released.add(rid)
        self._bidir_checks.update(getattr(metadata, "bidir_fence_checks", {}))

    def _bidir_bump(self, rid: str) -> None:
        words = self._bidir_words
        slot = self._bidir_slots.pop(rid, None)
        if words is not None and slot is not None:
            words[slot] = np.uint64(int(words[slot]) | BUMP_BIT)

    def _bidir_scribble(self, block_ids: list[int]) -> int:
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
        for rid in before - set(self._reqs_to_send):
            if getattr(self, "_bidir_slots", None):
                self._bidir_bump(rid)  # expired: freed without P's notification

    def get_transfer_results(self) -> Any:
        results = super().get_transfer_results()
        released = getattr(self, "_bidir_released", None)
        if released:
            results.finished_sending.update(released)
            released.clear()
        slots = getattr(self, "_bidir_slots", None)
        if slots:
            for rid in results.finished_sending:  # notified: the word keeps its value
                slots.pop(rid, None)
        return results

    # ---- the fence: P ------------------------------------------------------------------

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        done, failed = super()._pop_done_transfers(transfers)
        checks: dict[str, tuple[int, int, int, str]] | None = getattr(self, "_bidir_checks", None)
        if (
            checks is None
            or transfers is not self._recving_transfers
            or (not checks and not self._bidir_reads)
        ):
            return done, failed
        for rid in failed:
            checks.pop(rid, None)
        for rid in list(done):
            check = checks.pop(rid, None)
            if check is None:
                continue
            done.discard(rid)  # reported once its word is read
            if not self._bidir_post(rid, check):
                self._bidir_discard(rid, check[3], "its fence word could not be read")
                failed.add(rid)
        for rid, (handle, idx, gen, engine) in list(self._bidir_reads.items()):
            try:
                state = self.nixl_wrapper.check_xfer_state(handle)
            except Exception:
                state = "ERR"
            if state == "PROC":
                continue
            del self._bidir_reads[rid]
            value = int(self._bidir_scratch[idx]) if state == "DONE" else None
            with contextlib.suppress(Exception):
                self.nixl_wrapper.release_xfer_handle(handle)
            self._bidir_scratch_free.append(idx)
            if value == gen:
                done.add(rid)
            else:
                why = (
                    f"its fence word changed during the read ({gen} -> {value})"
                    if value is not None
                    else f"its fence word READ ended in {state}"
                )
                self._bidir_discard(rid, engine, why)
                failed.add(rid)
        return done, failed

    def _bidir_post(self, rid: str, check: tuple[int, int, int, str]) -> bool:
        slot, gen, base, engine = check
        agents = self._remote_agents.get(engine) or {}
        name = agents.get((0, 0)) or next(iter(agents.values()), None)
        if name is None or not self._bidir_scratch_free or not 0 <= slot < FENCE_SLOTS:
            return False
        try:
            remote = self._bidir_remote.get((engine, base))
            if remote is None:
                descs = self.nixl_wrapper.get_xfer_descs(
                    [(base + 8 * i, 8, 0) for i in range(FENCE_SLOTS)], _MEM
                )
                remote = self.nixl_wrapper.prep_xfer_dlist(name, descs)
                self._bidir_remote[(engine, base)] = remote
            idx = self._bidir_scratch_free.popleft()
            self._bidir_scratch[idx] = 0
            handle = self.nixl_wrapper.make_prepped_xfer(
                "READ", self._bidir_scratch_dlist, [idx], remote, [slot]
            )
            self.nixl_wrapper.transfer(handle)
        except Exception as exc:
            log.warning("bidir-kv: fence word READ of engine %s failed to post: %s", engine, exc)
            return False
        self._bidir_reads[rid] = (handle, idx, gen, engine)
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
