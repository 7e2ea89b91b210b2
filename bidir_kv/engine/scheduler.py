"""Scheduler side of the emulated engine: admission, role per request, step loop, retention.

One compute resource per engine: a step loop that spends a token budget
(``max_num_batched_tokens``) on decode tokens first and prefill chunks after, and
takes as long as the cost profile says. Protocol decisions (who pulls what, when
to decline, what to return) follow vLLM 0.33 as described in protocol.md and go
through :mod:`bidir_kv.policy`; moving bytes is the :class:`ConnectorWorker`'s job.

Deliberate differences from vLLM (docs/engine.md): a P with bidirectional mode off
ignores D's params instead of waiting forever (suspected defect 2); a declined or
failed read under ``recompute`` recomputes once and never re-queues a read (defect
1); blocks are paired by position unless ``kv_pairing="suffix-trim"`` (defect 3);
blocks for the whole request are reserved at admission (no preemption).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from bidir_kv.config import KVTransferConfig
from bidir_kv.engine.connector import ConnectorWorker, Peer
from bidir_kv.engine.faults import Faults
from bidir_kv.engine.guard import HandleTokens, verified_tokens
from bidir_kv.engine.kvcache import BlockManager, NoFreeBlocks
from bidir_kv.engine.metrics import EngineMetrics
from bidir_kv.engine.model import EOS, KVContent, next_token
from bidir_kv.engine.profiles import CostProfile
from bidir_kv.engine.transport.base import TransportError
from bidir_kv.policy import (
    LeaseTable,
    RetentionLedger,
    block_hashes,
    cdiv,
    heartbeat_interval,
    position_pairing,
    pull_decision,
    should_decline,
    suffix_trim_pairing,
)
from bidir_kv.protocol import KVTransferParams

__all__ = ["EngineCore", "EngineOptions", "Request", "RequestError"]

logger = logging.getLogger("bidir_kv.engine")

Pairing = Literal["position", "suffix-trim"]


class RequestError(Exception):
    """A request the engine refuses (HTTP 400) or fails (HTTP 500)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class EngineOptions:
    model_name: str
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_model_len: int = 32768
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    kv_capacity_tokens: int = 262144
    kv_pairing: Pairing = "position"
    emulate_vllm: str = "0.33"
    side_host: str = "localhost"
    metrics_log_interval: float = 10.0
    kv_verify: bool = True
    kv_guard: bool = True


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    params: KVTransferParams | None = None
    arrival: float = field(default_factory=time.perf_counter)
    # progress
    tokens: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    cached_tokens: int = 0
    external_tokens: int = 0
    state: str = "waiting"  # waiting | remote | running | finished
    abort_pending: bool = False  # aborted while a READ writes into its blocks
    finish_reason: str | None = None
    error: RequestError | None = None
    out_params: KVTransferParams | None = None
    first_token_time: float | None = None
    # incremental hashes and digests
    _chain: list[bytes] = field(default_factory=list)
    _registered: int = 0
    _h_pos: int = 0
    _h_val: int = 0
    _digest: bytes = b""
    _digested: int = 0
    events: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def is_p_node(self) -> bool:
        return self.params is not None and self.params.do_remote_decode


class EngineCore:
    """All engine state, driven by one asyncio task (the step loop)."""

    def __init__(
        self,
        opts: EngineOptions,
        kv: KVTransferConfig,
        profile: CostProfile,
        blocks: BlockManager,
        worker: ConnectorWorker,
        metrics: EngineMetrics,
        faults: Faults,
    ) -> None:
        self.opts = opts
        self.kv = kv
        self.profile = profile
        self.bm = blocks
        self.worker = worker
        self.metrics = metrics
        self.faults = faults
        self.clock = worker.clock
        self.content = KVContent(blocks.num_layers, blocks.per)
        self.ledger = RetentionLedger(ttl=kv.decoder_kv_blocks_ttl)
        self.leases = LeaseTable(duration=kv.kv_lease_duration)
        self._lease_blocks: dict[str, list[int]] = {}
        self._claimed: set[str] = set()
        self._handle_tokens: dict[str, HandleTokens] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self.requests_seen = 0
        self.num_remote = 0  # requests waiting for a READ (they hold blocks, not compute)

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._run())
        self._spawn(self._housekeeping())

    async def close(self) -> None:
        for t in [self._loop_task, *self._tasks]:
            if t is not None:
                t.cancel()
        for t in [self._loop_task, *self._tasks]:
            if t is not None:
                with contextlib.suppress(BaseException):  # shutdown: nobody to report to
                    await t

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- submission ----------------------------------------------------------------

    def new_request_id(self, prefix: str, base: str | None) -> str:
        return f"{prefix}-{base or uuid.uuid4().hex}-{uuid.uuid4().hex[:8]}"

    def submit(self, req: Request) -> Request:
        """Validate and queue a request (raises :class:`RequestError` for a 400)."""
        self.requests_seen += 1
        if self.faults.exit_on_request and self.requests_seen >= self.faults.exit_on_request:
            logger.error("fault exit_on_request=%d: exiting", self.faults.exit_on_request)
            os._exit(3)
        n = req.prompt_len
        if n == 0:
            raise RequestError(400, "The prompt is empty; at least one token is required.")
        if n + req.max_tokens > self.opts.max_model_len:
            raise RequestError(
                400,
                f"This model's maximum context length is {self.opts.max_model_len} tokens. "
                f"However, you requested {n + req.max_tokens} tokens ({n} in the messages, "
                f"{req.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
            )
        need = cdiv(n + max(req.max_tokens, 1) - 1, self.opts.block_size)
        if need > self.bm.num_usable_blocks:
            raise RequestError(
                400,
                f"request needs {need} KV blocks but the engine holds only "
                f"{self.bm.num_usable_blocks} (--kv-capacity-tokens)",
            )
        req.tokens = list(req.prompt)
        req._chain = block_hashes(req.prompt, self.opts.block_size)
        self.waiting.append(req)
        self.metrics.waiting.labels(**self.metrics.labels).set(len(self.waiting))
        self._wake.set()
        return req

    def abort(self, req: Request) -> None:
        """The client went away: finish as ``abort`` (no retention, no params)."""
        if req.state == "finished":
            return
        if req.state == "remote":
            req.abort_pending = True  # the READ still targets its blocks; finish after it
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")

    # ---- admission (scheduler-side decisions) ---------------------------------------

    def _admit(self) -> None:
        while self.waiting and len(self.running) + self.num_remote < self.opts.max_num_seqs:
            req = self.waiting[0]
            bs = self.opts.block_size
            n = req.prompt_len
            max_hit_blocks = (n - 1) // bs  # vLLM recomputes at least the last token
            hit_blocks = self.bm.lookup(req._chain[:max_hit_blocks])
            total = cdiv(n + max(req.max_tokens, 1) - 1, bs)
            try:
                self.bm.touch(hit_blocks)
                fresh = self.bm.allocate(total - len(hit_blocks))
            except NoFreeBlocks:
                self.bm.free(hit_blocks)
                return  # head-of-line waits for retained/leased blocks to be released
            self.waiting.popleft()
            req.blocks = [*hit_blocks, *fresh]
            req._registered = len(hit_blocks)
            h = len(hit_blocks) * bs
            req.num_computed = h
            req.cached_tokens = h
            self.metrics.prefix_cache(n, h)
            self._route(req, h)
        self.metrics.waiting.labels(**self.metrics.labels).set(len(self.waiting))

    def _route(self, req: Request, h: int) -> None:
        """Role from the params (spec §4): D's P->D pull, P's D->P pull, or plain."""
        p = req.params
        n = req.prompt_len
        if p is not None and (p.do_remote_prefill or (p.do_remote_decode and p.remote_block_ids)):
            self.metrics.c(self.metrics.external_queries, n)
            if not p.is_valid_remote:
                logger.warning(
                    "Got invalid KVTransferParams: %s. This request will not utilize KVTransfer",
                    p.to_dict(),
                )
            elif p.do_remote_prefill:
                self._start_pull(req, h, n - h, from_p=True)
                return
            elif not self.kv.bidirectional_kv_xfer:
                logger.debug(
                    "Ignoring D's kv_transfer_params for %s: bidirectional_kv_xfer is off",
                    req.request_id,
                )
            else:
                d = pull_decision(
                    prompt_tokens=n,
                    local_hit_tokens=h,
                    remote_num_tokens=p.remote_num_tokens,
                    block_size=self.opts.block_size,
                    threshold=self.kv.kv_recompute_threshold,
                )
                if d.pull:
                    self._start_pull(req, h, d.tokens, from_p=False)
                    return
                if d.reason == "below-threshold":
                    logger.debug(
                        "Skipping remote pull for %s: %d remote tokens < threshold %d",
                        req.request_id,
                        d.count,
                        self.kv.kv_recompute_threshold,
                    )
                self._spawn(self._notify_only(p))
        self._run_locally(req, h, external=0)

    def _run_locally(self, req: Request, h: int, external: int) -> None:
        n = req.prompt_len
        self.metrics.by_source(n - h - external, h, external)
        self.metrics.c(self.metrics.prompt_tokens, n)
        self.metrics.external_hit(external)
        req.external_tokens = external
        req.state = "running"
        self.running.append(req)
        self._wake.set()

    def _start_pull(self, req: Request, h: int, count: int, *, from_p: bool) -> None:
        p = req.params
        assert p is not None and p.remote_block_ids is not None
        bs = self.opts.block_size
        first, stop = h // bs, cdiv(h + count, bs)
        local = req.blocks[first:stop]
        remote_list = p.remote_block_ids[0] if p.remote_block_ids else []
        try:
            if self.opts.kv_pairing == "suffix-trim":
                remote = suffix_trim_pairing(remote_list, len(local))
            else:
                remote = position_pairing(remote_list, h, count, bs)
        except ValueError as exc:
            req.state = "remote"
            self.num_remote += 1
            self._spawn(self._pull_failed(req, h, f"cannot pair blocks: {exc}"))
            return
        req.state = "remote"
        self.num_remote += 1
        self._spawn(self._pull(req, h, count, local, remote, from_p))

    # ---- worker-side tasks ----------------------------------------------------------

    async def _peer_for(self, p: KVTransferParams) -> Peer:
        assert p.remote_host is not None and p.remote_port is not None
        return await self.worker.peer(p.remote_host, p.remote_port, p.remote_engine_id)

    async def _pull(
        self,
        req: Request,
        h: int,
        count: int,
        local: list[int],
        remote: list[int],
        from_p: bool,
    ) -> None:
        p = req.params
        assert p is not None and p.remote_request_id is not None
        hb: asyncio.Task[None] | None = None
        try:
            peer = await self._peer_for(p)
            if from_p:
                interval = heartbeat_interval(self.kv.kv_lease_duration)
                hb = self._spawn(
                    self.worker.heartbeat_loop(peer, [p.remote_request_id], interval)
                )
            elif self.kv.bidirectional_kv_xfer and should_decline(
                remote_expiry=p.remote_blocks_expiry_time, offset=peer.offset, now=self.clock()
            ):
                logger.warning(
                    "Declining expired remote read for %s from engine %s.",
                    req.request_id,
                    p.remote_engine_id,
                )
                self.metrics.expired()
                self._pull_resolved(req, h, 0, failed=True)
                return
            owner = await self.worker.claim(peer, p.remote_request_id, remote)
            if self.opts.kv_guard and owner is not None:
                count = self._guarded_count(req, h, count, owner, p)
                n = cdiv(h + count, self.opts.block_size) - h // self.opts.block_size
                local, remote = local[:n], remote[:n]
            if count <= 0:
                await self.worker.notify(peer, f"{p.remote_request_id}:1")
                self._pull_resolved(req, h, 0, failed=False)
                return
            res = await self.worker.read(
                peer, local, remote, f"{p.remote_request_id}:1", tokens=count
            )
        except Exception as exc:  # any failure ends in the policy, never in a hang
            self.metrics.transfer_failed()
            if isinstance(exc, TransportError | OSError):
                logger.warning("KV transfer for %s failed: %s", req.request_id, exc)
            else:
                logger.exception("KV transfer for %s failed unexpectedly", req.request_id)
            self._pull_resolved(req, h, 0, failed=True)
            return
        finally:
            if hb is not None:
                hb.cancel()
        self.metrics.read_done(res)
        if self.opts.kv_verify:
            self._verify(req, h, count)
        self._pull_resolved(req, h, count, failed=False)

    def _guarded_count(
        self, req: Request, h: int, count: int, owner: HandleTokens, p: KVTransferParams
    ) -> int:
        """Cap a pull at the prefix the owner provably holds for our prompt (guard.py).

        A capped pull below the threshold becomes notify-only, as vLLM's rule would
        have decided had it known."""
        bs = self.opts.block_size
        chain = req._chain[: req.prompt_len // bs]
        ok = verified_tokens(req.prompt, chain, owner, bs) - h
        if ok >= count:
            return count
        capped = max(ok, 0)
        threshold = self.kv.kv_recompute_threshold
        if not p.do_remote_prefill and threshold > 0 and capped < threshold:
            capped = 0
        logger.warning(
            "Prefix guard: prompt of %s does not continue request %s of engine %s after "
            "token %d; pulling %d of %d tokens",
            req.request_id,
            p.remote_request_id,
            p.remote_engine_id,
            h + max(ok, 0),
            capped,
            count,
        )
        self.metrics.c(self.metrics.guard_rejected, count - capped)
        return capped

    async def _pull_failed(self, req: Request, h: int, why: str) -> None:
        self.metrics.transfer_failed()
        logger.warning("KV transfer for %s failed: %s", req.request_id, why)
        self._pull_resolved(req, h, 0, failed=True)

    def _pull_resolved(self, req: Request, h: int, count: int, *, failed: bool) -> None:
        self.num_remote -= 1
        if req.abort_pending:
            self._finish(req, "abort")
            return
        if failed and self.kv.kv_load_failure_policy == "fail":
            req.error = RequestError(500, "Internal server error")
            self._finish(req, "error")
            return
        n = req.prompt_len
        loaded = h + count
        req.num_computed = loaded
        if count:
            req.cached_tokens = loaded
            req._h_pos, req._h_val = 0, 0  # hash state is recomputed lazily up to `loaded`
            self._register_full_blocks(req)
        if req.num_computed >= n:
            req.num_computed = n - 1  # recompute the last prompt token to sample from it
        self._run_locally(req, h, external=count)

    async def _notify_only(self, p: KVTransferParams) -> None:
        try:
            peer = await self._peer_for(p)
            await self.worker.notify(peer, f"{p.remote_request_id}:1")
        except (TransportError, OSError) as exc:
            self.metrics.notification_failed()
            logger.warning("Notification to %s failed: %s", p.remote_engine_id, exc)

    def _verify(self, req: Request, h: int, count: int) -> None:
        """Compare pulled slots with what our own prompt implies (emulator-only metric)."""
        bs = self.opts.block_size
        end = h + count
        hashes = self._hashes(req, h, end)
        expected = self.content.slots(hashes)
        bad = 0
        for i, pos in enumerate(range(h, end, bs)):
            stop = min(end, pos + bs)
            got = self.bm.read_slots(req.blocks[pos // bs], 0, stop - pos)
            if not np.array_equal(got, expected[i * bs : i * bs + (stop - pos)]):
                bad += 1
        if bad:
            self.metrics.c(self.metrics.kv_mismatch, bad)
            logger.warning(
                "KV pulled for %s does not match its prompt in %d block(s)", req.request_id, bad
            )

    # ---- notifications (owner side) -------------------------------------------------

    async def on_notification(self, peer: str, message: bytes) -> None:
        text = message.decode("utf-8", errors="replace")
        if text.startswith("HB:"):
            ids = [i for i in text[3:].split(",") if i]
            ext = self.leases.heartbeat(ids, self.clock())
            for rid in ext:
                logger.debug(
                    "Heartbeat extended lease for request %s by %ds",
                    rid,
                    self.kv.kv_lease_duration * 2 // 3,
                )
            return
        rid, sep, n_text = text.rpartition(":")
        if not sep:
            logger.warning("Ignoring malformed notification %r from %s", text, peer)
            return
        try:
            n = max(1, int(n_text))
        except ValueError:
            logger.warning("Ignoring malformed notification %r from %s", text, peer)
            return
        if self.faults.roll(self.faults.drop_notifications):
            logger.info("fault drop_notifications: ignoring notification %r", text)
            return
        if rid in self.ledger:
            rel = self.ledger.notify(rid, n)
            if rel is not None:
                self._forget(rid)
                self.bm.free(rel.blocks)
        elif rid in self.leases:
            self.leases.release(rid)
            self._forget(rid)
            self.bm.free(self._lease_blocks.pop(rid))
        else:
            logger.error(
                "Potentially invalid KV blocks for unrecognized request %s were retrieved by a "
                "decode worker. They may have expired.",
                rid,
            )
            self.metrics.notification_after_expiry()
            return
        self._wake.set()

    def claim(self, request_id: str, blocks: list[int]) -> str | None:
        """Grant single-use access to a held handle; return a refusal reason or None.

        After a grant, :meth:`handle_tokens` tells the reader what the handle holds."""
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
        return None

    def handle_tokens(self, request_id: str) -> HandleTokens | None:
        return self._handle_tokens.get(request_id)

    def _forget(self, request_id: str) -> None:
        self._claimed.discard(request_id)
        self._handle_tokens.pop(request_id, None)

    # ---- step loop ------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            self._admit()
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            while self.faults.stall:
                await asyncio.sleep(0.05)
            await self._step()

    async def _step(self) -> None:
        t0 = time.perf_counter()
        budget = self.opts.max_num_batched_tokens
        emitted: list[tuple[Request, int]] = []
        decodes = [r for r in self.running if r.num_computed >= r.prompt_len]
        for r in decodes:
            if budget <= 0:
                break
            budget -= 1
            self._compute(r, r.num_computed, r.num_computed + 1)
            emitted.append((r, self._sample(r)))
        prefill_tokens = 0
        ctx = 0
        for r in self.running:
            if budget <= 0:
                break
            if r.num_computed >= r.prompt_len:
                continue
            chunk = min(budget, r.prompt_len - r.num_computed)
            ctx = max(ctx, r.num_computed)
            self._compute(r, r.num_computed, r.num_computed + chunk)
            budget -= chunk
            prefill_tokens += chunk
            if r.num_computed >= r.prompt_len:
                emitted.append((r, self._sample(r)))
        modelled = self.profile.prefill_seconds(prefill_tokens, ctx)
        modelled += self.profile.decode_step_seconds(len(decodes))
        wait = modelled - (time.perf_counter() - t0) + self.faults.stall_seconds
        await asyncio.sleep(max(0.0, wait))
        for r, tok in emitted:
            self._emit(r, tok)
        self.metrics.running.labels(**self.metrics.labels).set(len(self.running))
        self.metrics.kv_usage.labels(**self.metrics.labels).set(self.bm.usage())

    def _hashes(self, req: Request, start: int, end: int) -> np.ndarray:
        """Token-prefix hashes of slots ``[start, end)``."""
        if req._h_pos > start:
            req._h_pos, req._h_val = 0, 0
        if req._h_pos < start:
            pre = self.content.prefix_hashes(req.tokens[req._h_pos : start], req._h_val)
            req._h_pos, req._h_val = start, int(pre[-1])
        hs = self.content.prefix_hashes(req.tokens[start:end], req._h_val)
        if len(hs):
            req._h_pos, req._h_val = end, int(hs[-1])
        return hs

    def _compute(self, req: Request, start: int, end: int) -> None:
        """Write KV for slots ``[start, end)`` and cache blocks that became full."""
        hs = self._hashes(req, start, end)
        self.bm.write_slots(req.blocks, start, self.content.slots(hs))
        req.num_computed = end
        self._register_full_blocks(req)

    def _register_full_blocks(self, req: Request) -> None:
        bs = self.opts.block_size
        full = req.num_computed // bs
        if len(req._chain) < full:
            parent = req._chain[-1] if req._chain else None
            start = len(req._chain) * bs
            more = (
                block_hashes(req.tokens[start : full * bs], bs, parent)
                if parent is not None
                else block_hashes(req.tokens[: full * bs], bs)
            )
            req._chain.extend(more)
        while req._registered < full:
            i = req._registered
            self.bm.cache(req.blocks[i], req._chain[i])
            req._registered += 1

    def _sample(self, req: Request) -> int:
        """Next token from the KV bytes of slots ``[0, num_computed)``."""
        bs = self.opts.block_size
        n = req.num_computed
        full = n // bs
        if req._digested > full:
            req._digest, req._digested = b"", 0
        while req._digested < full:
            d = hashlib.blake2b(req._digest, digest_size=16)
            d.update(self.bm.block_bytes(req.blocks[req._digested]))
            req._digest = d.digest()
            req._digested += 1
        tail = n - full * bs
        d = hashlib.blake2b(req._digest, digest_size=16)
        if tail:
            d.update(self.bm.block_bytes(req.blocks[full], tail))
        return next_token(d.digest(), req.tokens[n - 1], allow_eos=not req.ignore_eos)

    def _emit(self, req: Request, tok: int) -> None:
        if req.state == "finished":
            return
        now = time.perf_counter()
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.ttft.labels(**self.metrics.labels).observe(now - req.arrival)
        req.output.append(tok)
        req.tokens.append(tok)
        self.metrics.c(self.metrics.generation_tokens)
        stop = tok in req.stop_token_ids or (tok == EOS and not req.ignore_eos)
        req.events.put_nowait(tok)
        if stop:
            self._finish(req, "stop")
        elif len(req.output) >= req.max_tokens or len(req.tokens) >= self.opts.max_model_len:
            self._finish(req, "length")

    # ---- finishing, retention ----------------------------------------------------------

    def _finish(self, req: Request, reason: str) -> None:
        if req.state == "finished":
            return
        if req in self.running:
            self.running.remove(req)
        state_before = req.state
        req.state = "finished"
        req.finish_reason = reason
        self.metrics.c(self.metrics.request_success, finished_reason=reason)
        self.metrics.e2e.labels(**self.metrics.labels).observe(time.perf_counter() - req.arrival)
        if state_before == "waiting" or not req.blocks:
            req.blocks = []
        else:
            self._release_or_retain(req, reason)
        req.events.put_nowait(None)
        req.done.set()
        self._wake.set()

    def _release_or_retain(self, req: Request, reason: str) -> None:
        bs = self.opts.block_size
        keep_n = cdiv(req.num_computed, bs)
        keep, extra = req.blocks[:keep_n], req.blocks[keep_n:]
        self.bm.free(extra)
        p = req.params
        ok = reason in ("stop", "length") and keep_n > 0 and p is not None
        if ok and (req.is_p_node or self.kv.bidirectional_kv_xfer):
            self._handle_tokens[req.request_id] = HandleTokens.of(
                req.tokens[: req.num_computed], req._chain, bs
            )
        if ok and req.is_p_node:
            self.leases.hold(req.request_id, self.clock())
            self._lease_blocks[req.request_id] = keep
            req.out_params = self._node_params(req, keep, prefill=True, expiry=None)
        elif ok and self.kv.bidirectional_kv_xfer:
            deadline = self.ledger.retain(req.request_id, keep, self.clock())
            req.out_params = self._node_params(
                req, keep, prefill=False, expiry=deadline + self.faults.clock_skew
            )
        else:
            self.bm.free(keep)

    def _node_params(
        self, req: Request, blocks: list[int], *, prefill: bool, expiry: float | None
    ) -> KVTransferParams:
        fields: dict[str, Any] = {
            "do_remote_prefill": prefill,
            "do_remote_decode": not prefill,
            "remote_block_ids": [list(blocks)],
            "remote_engine_id": self.kv.engine_id,
            "remote_request_id": req.request_id,
            "remote_host": self.opts.side_host,
            "remote_port": self.worker.side_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": req.num_computed,
            "remote_blocks_expiry_time": expiry,
        }
        if self.opts.emulate_vllm != "0.32":
            fields["remote_registration_generation"] = 0
        fields["transfer_mode"] = "pull"
        if prefill:
            fields["remote_prefill_cached_tokens"] = req.cached_tokens
        return KVTransferParams.build(**fields)

    def usage_cached_tokens(self, req: Request) -> int:
        p = req.params
        if p is not None and p.do_remote_prefill and p.remote_prefill_cached_tokens is not None:
            return p.remote_prefill_cached_tokens
        return req.cached_tokens

    # ---- housekeeping ----------------------------------------------------------------

    async def _housekeeping(self) -> None:
        last_log = time.perf_counter()
        while True:
            await asyncio.sleep(0.1)
            now = self.clock()
            for rel in self.ledger.reap(now):
                self._expire(rel.request_id, list(rel.blocks), rel.reads)
            for rid in self.leases.reap(now):
                self._expire(rid, self._lease_blocks.pop(rid), 0)
            if time.perf_counter() - last_log >= self.opts.metrics_log_interval:
                last_log = time.perf_counter()
                window = self.metrics.take_window()
                if not window.empty():
                    logger.info("%s", window.log_line())

    def _expire(self, rid: str, blocks: list[int], reads: int) -> None:
        logger.warning(
            "Releasing expired KV blocks for request %s which were retrieved by %d remote "
            "worker(s) before lease expired.",
            rid,
            reads,
        )
        self.metrics.expired()
        self._forget(rid)
        self.bm.free(blocks)
        self._wake.set()

    def assert_idle(self) -> dict[str, int]:
        """Counts of what is still held (the suites' ``assert_scheduler_empty``)."""
        return {
            "waiting": len(self.waiting),
            "running": len(self.running),
            "retained": len(self.ledger),
            "leased": len(self.leases),
            "free_blocks": self.bm.num_free,
            "usable_blocks": self.bm.num_usable_blocks,
        }
