"""The vLLM-facing classes: vLLM's NIXL pull connector with the fixes of ``rules``.

Imported only by vLLM (through ``kv_connector_module_path``) or by tests in the
vLLM environment; importing it checks the vLLM release first
(:mod:`bidir_kv.connector.versions`). The scheduler side decides P's read here; the
worker side (:mod:`bidir_kv.connector.worker`) only re-handshakes a peer whose read
failed. The NIXL side channel, READs and notifications are vLLM's own, so the wire is
unchanged apart from the keys D adds to its params (:mod:`bidir_kv.wire.params`).
"""

from __future__ import annotations

import logging
from typing import Any

import vllm

from bidir_kv.connector.retention import FENCE_SLOTS, RetainedTurns
from bidir_kv.connector.rules import (
    PullPlan,
    Refusal,
    is_d_params,
    peer_refusal,
    plan_pull,
    positional_remote_blocks,
)
from bidir_kv.connector.versions import check_vllm_version
from bidir_kv.policy import PeerAllowlist
from bidir_kv.wire.fence import (
    ALLOWLIST_CONFIG_KEY,
    BUDGET_CONFIG_KEY,
    FAULT_RELEASE_CONFIG_KEY,
    FENCE_CONFIG_KEY,
    FENCE_KEY,
    advertises_fence,
    parse_budget,
    reader_advert,
    word_base,
    word_of,
    word_to_wire,
)
from bidir_kv.wire.ids import EngineId, RequestId
from bidir_kv.wire.params import (
    CHAIN_KEY,
    LEASE_CONFIG_KEY,
    LEASE_KEY,
    VERIFY_CONFIG_KEY,
    VERIFY_KEY,
    HeldTokens,
    configured_lease,
    lease_to_wire,
    verifier_advert,
)

VLLM_RELEASE = check_vllm_version(vllm.__version__)

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    NixlPullConnector,
    NixlPullConnectorScheduler,
)

from bidir_kv.connector.worker import BidirKVWorker  # noqa: E402

__all__ = [
    "VLLM_RELEASE",
    "BidirKVConnector",
    "BidirKVScheduler",
    "lease_from_config",
]

# A child of vLLM's "vllm" logger, so our lines get vLLM's handler, format and level
# (VLLM_LOGGING_LEVEL); a logger of our own would drop INFO under the root's WARNING.
log = logging.getLogger("vllm.bidir_kv.connector")
_WHY = {
    Refusal.FEATURE_OFF: "bidirectional_kv_xfer is off on this node, so D's blocks "
    "are not read; computing locally (stock vLLM waits for ever here, vLLM PR #32553 "
    "path; D frees its blocks at its decoder_kv_blocks_ttl)",
    Refusal.HOST_BUFFER: "this node stages KV in a host buffer, which has no D->P "
    "read path; computing locally (stock vLLM waits for ever here)",
    Refusal.ALREADY_READ: "its single read of D's blocks was already made or declined; "
    "recomputing (stock vLLM claims the load again and stalls, vLLM PRs #47021/#34896)",
    Refusal.BLOCK_LAYOUT: "D's block lists are not one block per position from token 0 "
    "(sliding window or Mamba groups); recomputing rather than pairing blindly",
}


def lease_from_config(kv: Any) -> float | None:
    """D's renewable lease from vLLM's ``KVTransferConfig`` (``None``: not configured)."""
    return configured_lease(kv.get_from_extra_config(LEASE_CONFIG_KEY, None))


class BidirKVScheduler(NixlPullConnectorScheduler):
    """P's D->P read decided by :func:`bidir_kv.connector.rules.plan_pull`; D's
    params carry its token chain."""

    def __init__(self, vllm_config: Any, engine_id: EngineId, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        kv = vllm_config.kv_transfer_config
        self._verify = bool(kv.get_from_extra_config(VERIFY_CONFIG_KEY, True))
        self._lease = lease_from_config(kv)
        self._hits: dict[RequestId, int] = {}  # request id -> P's local hit behind a claimed load
        # a malformed allowlist stops the start (ValueError): a security setting is
        # never dropped silently
        self._allow = PeerAllowlist.parse(kv.get_from_extra_config(ALLOWLIST_CONFIG_KEY, None))
        self._producer = kv.kv_role == "kv_producer"
        self._refused_peers: set[tuple[Any, ...]] = set()
        self.num_peer_refused = 0
        if self._allow is None:
            log.info(
                "bidir-kv: %s is unset: KV is read from any peer that "
                "kv_transfer_params name (vLLM's behaviour).",
                ALLOWLIST_CONFIG_KEY,
            )
        else:
            log.info("bidir-kv: peer allowlist: KV is read only from %s.", self._allow.describe())
        self._init_fence(kv, kv_cache_config)

    def _init_fence(self, kv: Any, kv_cache_config: Any) -> None:
        """The fence and the retention budget (docs/connector.md §5): bad values are one
        warning each and stock behaviour."""
        fence = kv.get_from_extra_config(FENCE_CONFIG_KEY, True)
        if not isinstance(fence, bool):
            log.warning(
                "bidir-kv: kv_connector_extra_config.%s must be true or false, got "
                "%r; running without the fence (stock behaviour).",
                FENCE_CONFIG_KEY,
                fence,
            )
            fence = False
        self._fence = fence and bool(self.is_bidirectional_kv_xfer_enabled)
        self._budget, problem = parse_budget(kv.get_from_extra_config(BUDGET_CONFIG_KEY, None))
        if problem:
            log.warning("bidir-kv: %s.", problem)
        self._total_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        self._turns = RetainedTurns(FENCE_SLOTS)
        self._fence_base: int | None = None  # D's word table, learnt from our worker
        self._fence_reads = False  # our worker can READ a peer's word (P's advert)
        self._fence_writes: dict[str, tuple[int, int]] = {}
        self._to_release: set[str] = set()
        self._releasing: set[str] = set()
        self._fence_checks: dict[str, tuple[int, int, int, str]] = {}
        self._asked: set[str] = set()
        self._stock_readers: set[Any] = set()
        self.num_released_early = {"budget": 0, "pressure": 0, "fault": 0}
        self._fault_release = kv.get_from_extra_config(FAULT_RELEASE_CONFIG_KEY, False) is True
        self._scribble: dict[str, list[int]] = {}
        if self._fault_release and self._fence:
            log.warning(
                "bidir-kv: fault injection %s: every fenced turn is released and "
                "overwritten right after it is exported.",
                FAULT_RELEASE_CONFIG_KEY,
            )

    def set_xfer_handshake_metadata(self, metadata: dict[Any, Any]) -> None:
        """Our worker said, on its handshake payload, whether its fence words are
        registered and where; the served payload is vLLM's (msgspec encodes fields only)."""
        if self._fence:
            ok = len(metadata) == 1 and all(
                getattr(m, "bidir_fence_ok", False) for m in metadata.values()
            )
            if ok:
                self._fence_base = getattr(next(iter(metadata.values())), "bidir_fence_base", None)
                self._fence_reads = True
            else:
                log.warning(
                    "bidir-kv: the fence is off: %s; retained turns are kept until "
                    "P's notification or the TTL (stock behaviour).",
                    "it runs with one worker (TP 1) only"
                    if len(metadata) != 1
                    else "the fence words could not be registered",
                )
                self._fence = False
        super().set_xfer_handshake_metadata(metadata)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        rid = request.request_id
        if rid in self._asked and self._fence:  # asked again, never allocated: no blocks
            self._pressure(rid)
        self._asked.add(rid)
        refused = peer_refusal(request.kv_transfer_params, self._allow, producer=self._producer)
        if refused is not None:
            self._refuse_peer(request, refused)
            return 0, False
        plan = plan_pull(
            request.kv_transfer_params,
            list(request.prompt_token_ids or ()),
            num_computed_tokens,
            self.block_size,
            bidirectional=bool(self.is_bidirectional_kv_xfer_enabled),
            host_buffer=bool(self.use_host_buffer),
            threshold=self.kv_recompute_threshold,
            verify=self._verify,
        )
        if plan is None:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._log_plan(request.request_id, plan)
        if plan.tokens <= 0:
            self._hits.pop(request.request_id, None)
            return 0, False
        self._hits[request.request_id] = num_computed_tokens
        return plan.tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        self._asked.discard(request.request_id)
        if (
            self._fence_reads
            and num_external_tokens > 0
            and is_d_params(params)
            and not params.get("_remote_blocks_processed")
        ):
            word, base = word_of(params), word_base(params)
            if word is not None and base is not None:
                self._fence_checks[request.request_id] = (
                    *word,
                    base,
                    str(params["remote_engine_id"]),
                )
        hit = self._hits.pop(request.request_id, None)
        if (
            hit is not None
            and num_external_tokens > 0
            and is_d_params(params)
            and not params.get("_remote_blocks_processed")
        ):
            params["remote_block_ids"] = positional_remote_blocks(
                params["remote_block_ids"], hit, num_external_tokens, self.block_size
            )
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._hits.pop(request.request_id, None)
        self._asked.discard(request.request_id)
        delay, out = super().request_finished(request, block_ids)
        if delay and out and out.get("do_remote_decode") and self.is_bidirectional_kv_xfer_enabled:
            n = int(out.get("remote_num_tokens") or 0)
            held = HeldTokens.of(list(request.all_token_ids[:n]), self.block_size)
            out[CHAIN_KEY] = held.to_wire()
            if self._lease is not None:  # the router frees these blocks once idle
                out[LEASE_KEY] = lease_to_wire(self._lease)
            if self._fence:
                self._retain(request, block_ids, out)
        elif out and out.get("do_remote_prefill"):  # P's dict, handed on with its prefill
            if delay and self._fence_reads:
                out[FENCE_KEY] = reader_advert()  # D may release this turn's successor early
            if self._verify and self.is_bidirectional_kv_xfer_enabled:
                out[VERIFY_KEY] = verifier_advert()  # a router may forward D's whole dict
        return delay, out

    # ---- the fence and the retention budget (D) ---------------------------------------

    def _retain(self, request: Any, block_ids: Any, out: dict[str, Any]) -> None:
        """Export a fence word for a turn whose prefill advertised the fence; then hold
        the budget."""
        rid = request.request_id
        params = request.kv_transfer_params or {}
        fenced = self._fence_base is not None and advertises_fence(params)
        nblocks = max((len(g) for g in block_ids), default=0)
        word = self._turns.retain(rid, nblocks, fenced=fenced)
        if word is not None:
            out[FENCE_KEY] = word_to_wire(*word, base=self._fence_base)
            self._fence_writes[rid] = word
            if self._fault_release:  # the reader finds the turn released and reused
                self._scribble[rid] = [int(b) for b in block_ids[0]] if block_ids else []
                self._release(rid, "fault", rid)
        elif not fenced and params.get("remote_engine_id") not in self._stock_readers:
            self._stock_readers.add(params.get("remote_engine_id"))
            log.info(
                "bidir-kv: turns prefilled by engine %s are not fenced (its dict does "
                "not advertise the fence); they are kept until its notification or the "
                "TTL, as vLLM keeps them (logged once per engine).",
                params.get("remote_engine_id"),
            )
        if self._budget is not None and self._total_blocks:
            for victim in self._turns.over_budget(
                self._budget, self._total_blocks, keep=rid, releasing=self._releasing
            ):
                self._release(victim, "budget", rid)

    def _pressure(self, waiting: str) -> None:
        """A request was asked about again without an allocation: it waits for blocks
        (or a sequence slot). Release the oldest fenced retained turn, one per step."""
        victim = self._turns.oldest_fenced(exclude=self._releasing)
        if victim is not None:
            self._release(victim, "pressure", waiting)

    def _release(self, victim: str, reason: str, for_request: str) -> None:
        self._releasing.add(victim)
        self._to_release.add(victim)
        self.num_released_early[reason] += 1
        why = {
            "budget": "over the retention budget",
            "fault": "fault injection",
            "pressure": "a request is waiting for KV blocks",
        }[reason]
        log.info(
            "bidir-kv: releasing fenced retained turn %s before its TTL (%s; for "
            "request %s); its fence word changes before its blocks are freed.",
            victim,
            why,
            for_request,
        )

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        # our worker reads these (BidirKVWorker.start_load_kv); vLLM's ignores them
        meta.bidir_fence_writes, self._fence_writes = self._fence_writes, {}
        meta.bidir_fence_release, self._to_release = self._to_release, set()
        meta.bidir_fence_checks, self._fence_checks = self._fence_checks, {}
        meta.bidir_fence_scribble, self._scribble = self._scribble, {}
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        for rid in connector_output.finished_sending or ():
            self._turns.finished(rid)
            self._releasing.discard(rid)

    def _refuse_peer(self, request: Any, why: Refusal) -> None:
        """Compute locally and never connect: the params are marked as processed, so
        vLLM's update_state_after_alloc queues neither a read nor a notification."""
        params = request.kv_transfer_params
        peer = (params.get("remote_engine_id"), params.get("remote_host"))
        params["do_remote_prefill"] = False
        params["_remote_blocks_processed"] = True
        self.num_peer_refused += 1
        if (why, *peer) in self._refused_peers:
            return
        self._refused_peers.add((why, *peer))
        if why == Refusal.REMOTE_PREFILL_ON_P:
            text = (
                "this is a prefill node (kv_role kv_producer) and was given "
                "do_remote_prefill params"
            )
        else:
            allowed = self._allow.describe() if self._allow is not None else ""
            text = f"the peer is outside {ALLOWLIST_CONFIG_KEY} ({allowed})"
        log.warning(
            "bidir-kv: request %s: not connecting to engine %s at %s:%s: %s; "
            "computing locally (logged once per peer).",
            request.request_id,
            peer[0],
            peer[1],
            params.get("remote_port"),
            text,
        )

    @staticmethod
    def _log_plan(req_id: RequestId, plan: PullPlan) -> None:
        if plan.reason in _WHY:
            level = logging.WARNING if plan.reason == Refusal.FEATURE_OFF else logging.INFO
            log.log(level, "bidir-kv: request %s: %s.", req_id, _WHY[Refusal(plan.reason)])
        elif plan.capped:
            log.info(
                "bidir-kv: request %s: the prompt continues D's sequence for %d tokens "
                "only; reading %d of the %d tokens stock vLLM would read (vLLM issue "
                "#43094).",
                req_id,
                plan.verified,
                plan.tokens,
                plan.offered,
            )
        else:
            log.debug("bidir-kv: request %s: %s, %d tokens.", req_id, plan.reason, plan.tokens)


class BidirKVConnector(NixlPullConnector):
    """vLLM's ``NixlConnector`` (pull mode) with :class:`BidirKVScheduler` and
    :class:`~bidir_kv.connector.worker.BidirKVWorker`. Same constructor and config keys
    as vLLM's."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            # vLLM's scheduler built by super() has started nothing yet (its handshake
            # listener starts with set_xfer_handshake_metadata), so replacing it is safe.
            self.connector_scheduler = BidirKVScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif self.connector_worker is not None:
            # the worker holds a NIXL agent already: change its class, not the object
            self.connector_worker.__class__ = BidirKVWorker
