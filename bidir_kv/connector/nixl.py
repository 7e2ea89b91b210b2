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

from bidir_kv.connector.fence import SchedulerFence
from bidir_kv.connector.rules import (
    PullPlan,
    Refusal,
    is_d_params,
    layout_of,
    peer_refusal,
    plan_pull,
    positional_remote_blocks,
)
from bidir_kv.connector.versions import check_vllm_version
from bidir_kv.policy import GroupRefusal, PeerAllowlist
from bidir_kv.wire.fence import ALLOWLIST_CONFIG_KEY, FENCE_KEY
from bidir_kv.wire.ids import EngineId, RequestId
from bidir_kv.wire.params import (
    CHAIN_KEY,
    GROUPS_KEY,
    LEASE_CONFIG_KEY,
    LEASE_KEY,
    VERIFY_CONFIG_KEY,
    VERIFY_KEY,
    HeldTokens,
    configured_lease,
    groups_to_wire,
    lease_to_wire,
    verifier_advert,
)

VLLM_RELEASE = check_vllm_version(vllm.__version__)

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    NixlPullConnector,
    NixlPullConnectorScheduler,
)

from bidir_kv.connector.worker import (  # noqa: E402
    FENCE_BASE_ATTR,
    BidirKVMetadata,
    BidirKVWorker,
)

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


_GROUP_REFUSALS = frozenset(str(r) for r in GroupRefusal)


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
        # the model's KV cache groups (None: one full-attention group): P cuts D's lists
        # with them, D describes them in its dict for a router (docs/protocol.md §6.4)
        groups = getattr(kv_cache_config, "transfer_groups", None)
        if groups is None:
            groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        self._layout = layout_of([g.kv_cache_spec for g in groups])
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
        # D's and P's fence and the retention budget (docs/connector.md §5)
        self.fence = SchedulerFence(
            kv.kv_connector_extra_config,
            bidirectional=bool(self.is_bidirectional_kv_xfer_enabled),
            total_blocks=int(kv_cache_config.num_blocks),
        )

    def set_xfer_handshake_metadata(self, metadata: dict[Any, Any]) -> None:
        """Our worker said, on its handshake payload, where its fence words are
        registered; the served payload is vLLM's (msgspec encodes fields only, and ours
        is an attribute, so a payload built by anything else has none)."""
        self.fence.worker_ready([getattr(m, FENCE_BASE_ATTR, None) for m in metadata.values()])
        super().set_xfer_handshake_metadata(metadata)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        self.fence.asked(request.request_id)
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
            layout=self._layout,
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
        self.fence.allocated(request.request_id)
        hit = self._hits.pop(request.request_id, None)
        reads = (
            num_external_tokens > 0
            and is_d_params(params)
            and not params.get("_remote_blocks_processed")
        )
        if reads:
            self.fence.check_after_read(request.request_id, params)
        if hit is not None and reads:
            params["remote_block_ids"] = positional_remote_blocks(
                params["remote_block_ids"], hit, num_external_tokens, self.block_size, self._layout
            )
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._hits.pop(request.request_id, None)
        self.fence.allocated(request.request_id)
        delay, out = super().request_finished(request, block_ids)
        if delay and out and out.get("do_remote_decode") and self.is_bidirectional_kv_xfer_enabled:
            n = int(out.get("remote_num_tokens") or 0)
            held = HeldTokens.of(list(request.all_token_ids[:n]), self.block_size)
            out[CHAIN_KEY] = held.to_wire()
            if self._layout is not None:  # a router needs the layout to cut several lists
                out[GROUPS_KEY] = groups_to_wire(self._layout)
            if self._lease is not None:  # the router frees these blocks once idle
                out[LEASE_KEY] = lease_to_wire(self._lease)
            word = self.fence.retain(request.request_id, request.kv_transfer_params, block_ids)
            if word is not None:
                out[FENCE_KEY] = word
        elif out and out.get("do_remote_prefill"):  # P's dict, handed on with its prefill
            advert = self.fence.advert() if delay else None
            if advert is not None:
                out[FENCE_KEY] = advert  # D may release this turn's successor early
            if self._verify and self.is_bidirectional_kv_xfer_enabled:
                out[VERIFY_KEY] = verifier_advert()  # a router may forward D's whole dict
        return delay, out

    def build_connector_meta(self, scheduler_output: Any) -> BidirKVMetadata:
        return BidirKVMetadata(
            super().build_connector_meta(scheduler_output), self.fence.take_meta()
        )

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        self.fence.sent(connector_output.finished_sending or ())

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
        elif plan.reason in _GROUP_REFUSALS:
            log.info(
                "bidir-kv: request %s: D's KV cache groups cannot be read up to the prefix "
                "its chain proves (%s: a sliding window D no longer holds there, or a "
                "group kind that cannot be cut); recomputing.",
                req_id,
                plan.reason,
            )
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
