"""The connector's decisions, pure: what P reads from D, and from which D blocks.

No vLLM here (unit-testable anywhere); the vLLM subclasses in
:mod:`bidir_kv.connector.nixl` call these and log the reason. Each refusal names the
upstream defect it avoids (docs/connector.md):

* feature off / host buffer: vLLM answers "async load" and never queues a read, so
  the request waits for ever (defect 2, the D->P branch added by vLLM PR #32553);
* already read: after a declined or failed read under ``kv_load_failure_policy:
  recompute`` (vLLM PRs #47021, #34896) vLLM asks again with the same params and
  again answers "async load" that is never queued (defect 1);
* unverified / misaligned: vLLM never checks that the prompt continues D's sequence
  (vLLM issue #43094, PR #44838); we pull only the prefix D's chain proves;
* block layout: position pairing needs D's list to be one block per position from
  token 0 (full attention). With several KV cache groups (vLLM's hybrid manager, PR
  #41847) every group is cut where its attention allows (``policy.trim_groups``: a
  sliding window only where D still holds what it needs), else the read is refused with
  the rule's reason; Mamba and other kinds are recomputed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from bidir_kv.policy import (
    GroupKind,
    KVGroup,
    PeerAllowlist,
    blocks_for_tokens,
    pull_decision,
    target_block_range,
    trim_groups,
    verified_continuation,
)
from bidir_kv.wire.ids import BlockIds
from bidir_kv.wire.params import HeldTokens

__all__ = [
    "PullPlan",
    "Refusal",
    "is_d_params",
    "layout_of",
    "peer_refusal",
    "plan_pull",
    "positional_remote_blocks",
]

_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


class Refusal(StrEnum):
    PEER_NOT_ALLOWED = "peer-not-allowed"  # params name a peer outside the allowlist
    REMOTE_PREFILL_ON_P = "remote-prefill-on-p"  # a kv_producer given D-bound params
    FEATURE_OFF = "feature-off"  # bidirectional_kv_xfer is off on this P
    HOST_BUFFER = "host-buffer"  # P stages KV in host memory: no D->P read path
    ALREADY_READ = "already-read"  # this dict's single read was made (or declined)
    BLOCK_LAYOUT = "block-layout"  # D's lists are not one block per position from 0


@dataclass(frozen=True, slots=True)
class PullPlan:
    """What P does with D's params: load ``tokens`` asynchronously (0: none).

    ``offered`` is what stock vLLM would have loaded (``min(remote, prompt) - hit``),
    ``verified`` the prompt tokens D's chain proves (``None``: not checked),
    ``reason`` a refusal or a ``policy.PullReason`` value.
    """

    tokens: int
    offered: int
    verified: int | None
    reason: str

    @property
    def capped(self) -> bool:
        """The guard cut the pull below what stock vLLM would have loaded."""
        return self.verified is not None and self.tokens < self.offered and self.offered > 0


def layout_of(specs: Sequence[Any]) -> tuple[KVGroup, ...] | None:
    """The KV cache groups of vLLM's transfer groups' specs (``kv_cache_spec`` of each),
    read by class name so every release's classes are read alike: a sliding window, full
    attention (MLA and sink variants included; not the R-SWA gap), or another kind that
    is never cut. ``None`` for one full-attention group (a dense model)."""
    out: list[KVGroup] = []
    for spec in specs:
        names = {c.__name__ for c in type(spec).__mro__}
        bs = int(spec.block_size)
        if "SlidingWindowSpec" in names:
            out.append(KVGroup.sliding(int(spec.sliding_window), bs))
        elif "FullAttentionSpec" in names and "RSWASpec" not in names:
            out.append(KVGroup.full(bs))
        else:
            out.append(KVGroup(type(spec).__name__, bs))
    if len(out) == 1 and out[0].kind == GroupKind.FULL:
        return None
    return tuple(out)


def is_d_params(params: Mapping[str, Any] | None) -> bool:
    """A D-node dict P could read from (vLLM's own test in get_num_new_matched_tokens)."""
    return bool(
        params
        and params.get("do_remote_decode")
        and params.get("remote_block_ids")
        and all(k in params for k in _REMOTE_KEYS)
    )


def peer_refusal(
    params: Mapping[str, Any] | None, allowlist: PeerAllowlist | None, *, producer: bool
) -> Refusal | None:
    """Why this node must not connect where ``params`` say (``None``: it may).

    A prefill node (``kv_role: kv_producer``) never pulls a remote prefill; with an
    allowlist, a remote prefill or a D dict naming a peer outside it is refused. The
    caller computes locally and opens no connection (docs/connector.md §7)."""
    if not params:
        return None
    prefill = bool(params.get("do_remote_prefill"))
    if not prefill and not is_d_params(params):
        return None
    if prefill and producer:
        return Refusal.REMOTE_PREFILL_ON_P
    if allowlist is not None and not allowlist.allows(
        params.get("remote_engine_id"), params.get("remote_host")
    ):
        return Refusal.PEER_NOT_ALLOWED
    return None


def _layout_ok(remote_block_ids: Sequence[Sequence[int]], remote: int, block_size: int) -> bool:
    # D allocates for its computed tokens, plus at most one block for the sampled
    # token it never computed; one block per position from token 0 in every group.
    need = blocks_for_tokens(remote, block_size)
    return all(need <= len(group) <= need + 1 for group in remote_block_ids)


def plan_pull(
    params: Mapping[str, Any] | None,
    prompt: Sequence[int],
    num_computed: int,
    block_size: int,
    *,
    bidirectional: bool,
    host_buffer: bool,
    threshold: int,
    verify: bool = True,
    layout: Sequence[KVGroup] | None = None,
) -> PullPlan | None:
    """P's decision on a D-node dict; ``None`` when ``params`` are not one (vLLM decides).

    ``num_computed`` is P's block-aligned local hit; ``verify=False`` trusts D's
    ``remote_num_tokens`` as stock vLLM does (position pairing still applies).
    ``layout``: P's own KV cache groups (:func:`layout_of`; D runs the same model), whose
    lists are cut at the pull's end by ``policy.trim_groups`` (``None``: one group).
    """
    if not is_d_params(params):
        return None
    assert params is not None
    remote = int(params.get("remote_num_tokens") or 0)
    offered = min(remote, len(prompt)) - num_computed
    if not bidirectional:
        return PullPlan(0, offered, None, Refusal.FEATURE_OFF)
    if host_buffer:
        return PullPlan(0, offered, None, Refusal.HOST_BUFFER)
    if params.get("_remote_blocks_processed"):
        return PullPlan(0, offered, None, Refusal.ALREADY_READ)
    if layout is None and not _layout_ok(params["remote_block_ids"], remote, block_size):
        return PullPlan(0, offered, None, Refusal.BLOCK_LAYOUT)
    verified: int | None = None
    if verify:
        # D's chain must cover everything the dict offers. It may cover more: a router's
        # guard lowers remote_num_tokens (and cuts the block lists) to the prefix the new
        # prompt continues and leaves D's chain as D wrote it (docs/connector.md §3.3)
        held = HeldTokens.from_params(params)
        ok = held is not None and held.block_size == block_size and held.num_tokens >= remote
        verified = (
            min(
                remote,
                verified_continuation(held.chain, held.tail, held.num_tokens, prompt, block_size),
            )
            if ok and held
            else 0
        )
    decision = pull_decision(
        prompt_tokens=len(prompt),
        local_hit_tokens=num_computed,
        remote_num_tokens=remote if verified is None else min(remote, verified),
        block_size=block_size,
        threshold=threshold,
    )
    if layout is not None and decision.tokens > 0:
        cut = trim_groups(
            params["remote_block_ids"], num_computed + decision.tokens, block_size, layout
        )
        if not cut.ok:  # e.g. a sliding window D no longer holds there: read nothing
            return PullPlan(0, offered, verified, cut.reason)
    return PullPlan(decision.tokens, offered, verified, str(decision.reason))


def positional_remote_blocks(
    remote_block_ids: Sequence[Sequence[int]],
    local_hit: int,
    tokens: int,
    block_size: int,
    layout: Sequence[KVGroup] | None = None,
) -> BlockIds:
    """D's lists cut to end at the last block P reads, so vLLM's suffix trim pairs by
    position (docs/protocol.md §6.3, defect 3).

    vLLM's worker pairs P's N new blocks with the *last* N of D's list; when D holds
    more than the prompt (a shorter or branched prompt) those are other positions.
    Cutting D's lists to blocks ``[0, cdiv(hit + tokens, bs))`` makes "the last N"
    exactly the blocks of positions ``[hit, hit + tokens)``; wire and worker unchanged.
    With a ``layout`` every group is cut by ``policy.trim_groups`` (a sliding list ends
    at the same block, as D would have exported it there), which :func:`plan_pull`
    accepted for this end (``ValueError`` otherwise).
    """
    if tokens <= 0:
        return [list(g) for g in remote_block_ids]
    if layout is not None:
        cut = trim_groups(remote_block_ids, local_hit + tokens, block_size, layout)
        if cut.block_ids is None:
            raise ValueError(f"D's groups cannot be cut at {local_hit + tokens}: {cut.reason}")
        return cut.block_ids
    stop = target_block_range(local_hit, tokens, block_size).stop
    return [list(g[:stop]) for g in remote_block_ids]
