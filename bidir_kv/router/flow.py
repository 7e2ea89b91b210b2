"""One client request through the router: identity, store, guard, P leg, D leg, store.

Wire behaviour follows vLLM's example multi-turn proxy (docs/protocol.md §9):
miss dict or D's cached dict to P (non-streaming, ``max_tokens=1``), P's dict
with ``remote_host`` rewritten to D, D's dict captured from the terminal chunk.
What is added: tenant-scoped single-use entries, the continuation guard,
retry-as-miss when reuse fails, sticky nodes, and stripping of internal params
from everything the client sees. The legs are :mod:`bidir_kv.router.prefill`
and :mod:`bidir_kv.router.decode`; what a turn leaves behind is written by
:mod:`bidir_kv.router.memo`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from bidir_kv.protocol import KVTransferParams
from bidir_kv.router.decode import DecodeLeg
from bidir_kv.router.failures import (
    JSON,
    Cause,
    Leg,
    UpstreamFailure,
    error_response_for,
    failure_label,
    unavailable_response,
)
from bidir_kv.router.guard import GuardVerdict, judge_continuation, release_params
from bidir_kv.router.history import History, history_of, opt_out
from bidir_kv.router.identity import (
    ConversationKey,
    IdentityError,
    cache_salt_for,
    conversation_key,
    tenant_digest,
)
from bidir_kv.router.intake import InputError, read_request
from bidir_kv.router.memo import TurnMemo
from bidir_kv.router.metrics import RouterMetrics
from bidir_kv.router.peers import PeerDropper
from bidir_kv.router.prefill import PrefillLeg, pulled_tokens
from bidir_kv.router.relay import RelayResult
from bidir_kv.router.release import Releaser
from bidir_kv.router.settings import RouterSettings
from bidir_kv.router.store import ConversationStore, Entry, StoreError, Taken
from bidir_kv.router.turn import TurnState, conv_label, record_client_gone
from bidir_kv.router.upstreams import (
    NodeFacts,
    Upstream,
    UpstreamPool,
    pair_problem,
    sizes_differ,
)
from bidir_kv.wire.params import advertises_verify

__all__ = ["RouterFlow"]

log = logging.getLogger("bidir_kv.router")

# What the client changes so its turns can reuse KV (issue: warnings name the fix).
NO_ID_FIX = (
    "To enable it, send the conversation's id as the body field conversation_id, the "
    "X-Session-ID header (vLLM's benchmark_serving_multi_turn.py: --send-conversation-id) "
    "or OpenAI's prompt_cache_key (chat turns are also recognised by their history "
    "unless the router runs with --identity id)."
)


class RouterFlow:
    """The request handler; owns nothing but references to pools, store and metrics."""

    def __init__(
        self,
        prefill: UpstreamPool,
        decode: UpstreamPool,
        store: ConversationStore,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        settings: RouterSettings,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.store = store
        self.metrics = metrics
        self.session = session
        self.settings = settings
        self.prefill_leg = PrefillLeg(prefill, session, settings, metrics)
        self.releaser = Releaser(prefill, decode, session, settings, metrics)
        store.on_evict = self._evicted  # evicted entries free D's blocks
        self.memo = TurnMemo(
            store,
            metrics,
            settings.guard,
            self.releaser,
            decode.hold,
            lease=settings.conversation_lease,
        )
        self.decode_leg = DecodeLeg(decode, session, settings, metrics, self.memo.release)
        self.peers = PeerDropper([prefill, decode], session, metrics)  # engine ids, drop_peer
        self.facts = NodeFacts(session, settings.block_size)  # each node's block size
        self.facts.adopt([prefill, decode])
        self._mismatches: set[str] = set()  # block-size problems already logged
        api_key = os.environ.get("OPENAI_API_KEY")
        self._api_auth = f"Bearer {api_key}" if api_key else None

    # ---- entry point ----------------------------------------------------------

    async def handle(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        m = self.metrics
        m.requests.labels(endpoint).inc()
        try:
            body = await read_request(request, self.settings.max_body_bytes, endpoint)
        except InputError as exc:
            m.errors.labels("bad_request").inc()
            return error_response_for(exc)
        rid = str(uuid.uuid4())
        if "kv_transfer_params" in body:
            body.pop("kv_transfer_params")
            m.client_params_dropped.inc()
            log.warning("[%s] dropped client-supplied kv_transfer_params", rid)
        tenant = tenant_digest(request.headers.get("Authorization"))
        salt = cache_salt_for(tenant)
        if salt is not None and "cache_salt" not in body:
            body["cache_salt"] = salt  # both legs; a client's own salt is kept
        try:
            key, history = self._identify(body, request, endpoint, tenant)
        except IdentityError as exc:
            m.errors.labels("bad_request").inc()
            return error_response_for(exc)
        headers = {"Content-Type": JSON, "X-Request-Id": rid}
        auth = self._api_auth or request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
        turn = TurnState(
            rid,
            endpoint,
            body,
            headers,
            key,
            body.get("stream") is True,
            guard=self.settings.guard,
            history=history,
        )
        try:
            return await self._run(request, turn)
        except asyncio.CancelledError:
            record_client_gone(turn, self.metrics)  # P/D requests closed on the way out
            raise
        finally:
            turn.cancel_tokenize()

    def _identify(
        self, body: dict[str, Any], request: web.Request, endpoint: str, tenant: str
    ) -> tuple[ConversationKey | None, History | None]:
        """The key this turn takes from the store and, for a turn recognised by its
        history, its digests; :class:`IdentityError` for an id or message it cannot
        read (the ids leave the body in every mode)."""
        mode = self.settings.identity
        key = conversation_key(body, request.headers)
        if mode == "history":
            key = None
        if key is not None or mode == "id":
            return key, None
        if opt_out(body, chat=endpoint == "chat/completions") is not None:
            return None, None
        history = history_of(body, tenant)
        return history.lookup, history

    def _evicted(self, entry: Entry, reason: str) -> None:
        """A store entry dropped unused: D no longer holds it for us; free its blocks."""
        self.decode.unhold(entry.decode, str(entry.params.remote_request_id))
        self.releaser.release_entry(entry, reason)

    async def _run(self, request: web.Request, turn: TurnState) -> web.StreamResponse:
        entry = await self._take(turn)
        await self.facts.settle(self.prefill, self.decode)  # once per node start
        if entry is not None:
            self.decode.unhold(entry.decode, str(entry.params.remote_request_id))
        p_node, d_node = self._place(entry)
        if p_node is None or d_node is None:
            down = [
                pool
                for pool, node in ((self.prefill, p_node), (self.decode, d_node))
                if not pool.healthy()
            ]
            if not down:  # both roles have healthy nodes, none of the same block size
                return unavailable_response(self.metrics, problem=self._mismatch())
            return unavailable_response(self.metrics, *down)
        # Reserved from the pick to the end of the D leg: turns picked while this one is
        # still in its P leg see it (placement would otherwise herd them onto one D).
        d_node.reserved += 1
        try:
            return await self._legs(request, turn, entry, p_node, d_node)
        finally:
            d_node.reserved -= 1

    def _place(self, entry: Entry | None) -> tuple[Upstream | None, Upstream | None]:
        """D (the holder of the blocks if healthy), then a P of the same block size; when
        no P fits that D, any D that some healthy P fits."""
        d_node = self.decode.pick(entry.decode if entry else None)
        p_node = self.prefill.pick(entry.prefill if entry else None, pair=d_node)
        if p_node is None and d_node is not None:
            fitting = [d for d in self.decode.healthy() if self.prefill.fits(d)]
            d_node = min(fitting, key=self.decode.load, default=None)
            p_node = self.prefill.pick(pair=d_node) if d_node is not None else None
        return p_node, d_node

    def _mismatch(self) -> str:
        """The 503's message, logged once per set of mismatched nodes."""
        problem = pair_problem(self.prefill, self.decode)
        if problem not in self._mismatches:
            self._mismatches.add(problem)
            log.error("%s", problem)
        return problem

    async def _legs(
        self,
        request: web.Request,
        turn: TurnState,
        entry: Entry | None,
        p_node: Upstream,
        d_node: Upstream,
    ) -> web.StreamResponse:
        hit, release = await self._reuse(turn, p_node, entry)
        if hit is not None:
            self.metrics.hit_offers.inc()
            log.info(
                "[%s] conv=%s: sending D's cached blocks to P (remote_request_id=%s)",
                turn.rid,
                turn.conv,
                hit.remote_request_id,
            )
        elif turn.key is not None:
            log.info("[%s] conv=%s: cache MISS", turn.rid, turn.conv)
        try:
            p_node, p_params = await self.prefill_leg.run_with_fallback(turn, p_node, hit, release)
        except UpstreamFailure as exc:
            return self._failure_response(turn, Leg.PREFILL, exc)
        if p_params is not None:
            if self.peers.seen(p_node, p_params.remote_engine_id):
                self.facts.forget(p_node)  # restarted under another id: ask it again
            # P's dict says whether it reads only what D's chain proves (wire.params)
            p_node.verifies = advertises_verify(p_params.extra)
        if hit is not None:
            self._count_hit(turn, hit, fell_back=turn.fell_back)
        if turn.prompt_tokens is None and turn.wants_ids:
            # P did not echo the prompt ids (and D may not on streams): tokenize off the
            # critical path, while D decodes.
            turn.tokenize_task = asyncio.create_task(
                self.prefill_leg.tokenize(turn, p_node, timed=False)
            )
        return await self.decode_leg.run(request, turn, p_node, d_node, p_params, self._remember)

    async def _remember(
        self, turn: TurnState, p_node: Upstream, d_node: Upstream, result: RelayResult
    ) -> None:
        if result.params is not None and self.peers.seen(d_node, result.params.remote_engine_id):
            self.facts.forget(d_node)
        await self.memo.remember(turn, p_node, d_node, result)

    def _count_hit(self, turn: TurnState, hit: KVTransferParams, fell_back: bool) -> None:
        """A hit is counted once P reports it took D's tokens (not when the dict is sent)."""
        if fell_back:
            return
        pulled = pulled_tokens(hit, turn.p_usage, p_trims=turn.p_trims)
        if pulled is None:  # P reports no cached tokens: count the hit it accepted
            self.metrics.hits.inc()
        elif pulled > 0:
            self.metrics.hits.inc()
            self.metrics.hit_tokens.inc(pulled)
        else:
            self.metrics.misses.labels("not_pulled").inc()
            log.info(
                "[%s] conv=%s: P did not take D's cached tokens (cached_tokens %s)",
                turn.rid,
                turn.conv,
                (turn.p_usage or {}).get("prompt_tokens_details"),
            )

    # ---- store and guard --------------------------------------------------------

    async def _take(self, turn: TurnState) -> Entry | None:
        m = self.metrics
        if turn.key is None and turn.history is not None:
            m.misses.labels("no_history").inc()  # no assistant message yet
            return None
        if turn.key is None:
            m.misses.labels("no_id").inc()
            log.warning(
                "[%s] No conversation_id provided — KV cache reuse disabled for this request. %s",
                turn.rid,
                NO_ID_FIX,
            )
            return None
        turn.since = self.store.now()
        try:
            if turn.history is not None:  # the longest prefix a stored turn shares
                taken = await self.store.take_first([k.storage_key for k in turn.history.probes])
            else:
                taken = await self.store.take(turn.key.storage_key)
        except StoreError as exc:
            m.errors.labels("store").inc()
            m.misses.labels("store_error").inc()
            log.error("[%s] conv=%s: %s; treating as a miss", turn.rid, turn.conv, exc)
            return None
        self._report_take(turn, taken)
        return taken.entry

    def _report_take(self, turn: TurnState, taken: Taken) -> None:
        """Count and log what the store decided (it judges staleness, not the flow)."""
        m = self.metrics
        if taken.stale:
            m.stale.inc()
            m.misses.labels("stale").inc()
            log.info(
                "conv=%s: stale cache entry (age=%.1fs > ttl=%.1fs), discarding",
                turn.conv,
                taken.age,
                self.store.ttl,
            )
        elif taken.entry is None:
            m.misses.labels("not_found").inc()
        elif turn.history is not None and taken.matched is not None:
            probe = turn.history.probes[taken.matched]
            exact = probe == turn.history.lookup
            m.history_matches.labels("exact" if exact else "prefix").inc()
            log.info(
                "conv=%s: cache HIT (age=%.1fs)%s",
                turn.conv,
                taken.age,
                "" if exact else f" on a shorter history ({conv_label(probe)})",
            )
        else:
            log.info("conv=%s: cache HIT (age=%.1fs)", turn.conv, taken.age)

    async def _reuse(
        self, turn: TurnState, p_node: Upstream, entry: Entry | None
    ) -> tuple[KVTransferParams | None, KVTransferParams | None]:
        """(hit, release): D's dict to reuse, or the dict that only frees D's blocks."""
        if entry is None:
            return None, None
        holder = self.decode.get(entry.decode)
        if holder is not None and not holder.healthy:
            self.metrics.misses.labels("holder_down").inc()
            log.info(
                "[%s] conv=%s: D %s holding the blocks is down; miss",
                turn.rid,
                turn.conv,
                entry.decode,
            )
            return None, None
        host = holder.host if holder is not None else entry.params.remote_host
        cached = entry.params.for_prefill_hit(host)
        if sizes_differ(p_node, holder):  # P cannot read that D's blocks by index
            self.metrics.misses.labels("block_size").inc()
            log.info(
                "[%s] conv=%s: P %s (block size %s) cannot read D %s (block size %s); miss",
                turn.rid,
                turn.conv,
                p_node.id,
                p_node.block_size,
                entry.decode,
                holder.block_size if holder is not None else None,
            )
            return None, release_params(cached)
        verdict = await self._guard(turn, p_node, holder, cached, entry)
        if verdict.accepted:
            return verdict.params, None
        # Not a hit: P recomputes everything; remote_num_tokens=0 only makes it
        # notify D, so the pinned blocks are freed now, not at the TTL.
        return None, release_params(cached)

    async def _guard(
        self,
        turn: TurnState,
        p_node: Upstream,
        holder: Upstream | None,
        cached: KVTransferParams,
        entry: Entry,
    ) -> GuardVerdict:
        m = self.metrics
        if not self.settings.guard:
            return GuardVerdict(cached, "guard-off")
        if p_node.verifies:
            # this P reads only the prefix D's chain proves for its own prompt: D's whole
            # dict goes to it and it cuts the read itself (no /tokenize round trip)
            turn.p_trims = True
            m.prefill_verified.inc()
            return GuardVerdict(cached, "prefill-verifies", cached.num_remote_tokens)
        try:
            prompt_tokens = await self.prefill_leg.tokenize(turn, p_node)
            turn.prompt_tokens = prompt_tokens
        except UpstreamFailure as exc:
            verdict = GuardVerdict(None, "tokenize-failed")
            log.warning("[%s] conv=%s: cannot verify continuation (%s)", turn.rid, turn.conv, exc)
        else:
            # D's blocks are what is trimmed: the size the holder reports (learned once
            # per start; --block-size for a node that reports none)
            block_size = (
                await self.facts.block_size(holder)
                if holder is not None
                else self.settings.block_size
            )
            verdict = judge_continuation(cached, entry.tokens, prompt_tokens, block_size)
        if verdict.accepted:
            if verdict.reason.startswith("trimmed"):
                m.guard_trims.inc()
                # the expected answer to a rewritten history, not a fault: INFO
                log.info(
                    "[%s] conv=%s: guard %s: reusing only %d tokens",
                    turn.rid,
                    turn.conv,
                    verdict.reason,
                    verdict.reusable_tokens,
                )
            return verdict
        m.guard_rejections.labels(verdict.reason).inc()
        m.misses.labels("guard").inc()
        log.warning(
            "[%s] conv=%s: guard rejected cached KV (%s); releasing D's blocks",
            turn.rid,
            turn.conv,
            verdict.reason,
        )
        return verdict

    # ---- errors ---------------------------------------------------------------

    def _failure_response(self, turn: TurnState, leg: Leg, exc: UpstreamFailure) -> web.Response:
        self.metrics.errors.labels(failure_label(leg, exc.cause)).inc()
        log.error("[%s] conv=%s: %s leg failed: %s", turn.rid, turn.conv, leg.value, exc)
        if exc.unreachable and not self.prefill.healthy():
            if self.decode.pick() is None:
                return unavailable_response(self.metrics, self.prefill, self.decode)
            return unavailable_response(self.metrics, self.prefill)
        answered = exc.cause is not Cause.TIMEOUT and not exc.unreachable
        if answered and exc.status is not None and exc.body is not None:  # the node's answer
            return web.Response(status=exc.status, body=exc.body, content_type=JSON)
        return error_response_for(exc)
