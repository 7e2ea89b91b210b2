"""aiohttp application of ``bidir-kv proxy``: routes, lifecycle, ``/health``, ``/metrics``."""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

from bidir_kv.router.conversations import ConversationRoutes, LeaseSweeper
from bidir_kv.router.failures import error_response
from bidir_kv.router.flow import RouterFlow
from bidir_kv.router.metrics import RouterMetrics
from bidir_kv.router.settings import RouterSettings
from bidir_kv.router.store import ConversationStore, StoreError, open_store
from bidir_kv.router.upstreams import HealthChecker, Upstream, UpstreamPool

__all__ = ["FLOW_KEY", "METRICS_KEY", "build_app"]

log = logging.getLogger("bidir_kv.router")

FLOW_KEY = web.AppKey("flow", RouterFlow)
METRICS_KEY = web.AppKey("metrics", RouterMetrics)  # the listener counts connections here


def build_app(settings: RouterSettings, store: ConversationStore | None = None) -> web.Application:
    """The router app; pools and store are created here, connections on startup."""
    router = _RouterApp(settings, store)
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[METRICS_KEY] = router.metrics
    app.on_startup.append(router.on_startup)
    app.on_cleanup.append(router.on_cleanup)
    app.router.add_post("/v1/chat/completions", router.chat)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_route)
    app.router.add_get("/v1/models", router.models)
    ConversationRoutes(router.store, router.metrics).add_to(app)
    return app


class _RouterApp:
    """The app's parts and its route handlers (the flow exists once a session does)."""

    def __init__(self, settings: RouterSettings, store: ConversationStore | None) -> None:
        self.settings = settings
        self.prefill = UpstreamPool("prefill", settings.prefill_hosts, settings.prefill_ports)
        self.decode = UpstreamPool(
            "decode",
            settings.decode_hosts,
            settings.decode_ports,
            held_weight=settings.held_weight,
            held_ttl=settings.cache_ttl,
        )
        self.store = store or open_store(
            settings.store,
            settings.cache_ttl,
            settings.max_conversations,
            max_concurrency=settings.max_concurrency,
        )
        self.metrics = RouterMetrics()
        self.checker: HealthChecker | None = None
        self.sweeper = LeaseSweeper(self.store, self.metrics, settings.lease_sweep_interval)

    async def on_startup(self, app: web.Application) -> None:
        # Idle upstream connections are dropped before uvicorn's (and vLLM's) 5 s
        # keep-alive closes them, so a reused connection is never a half-closed one.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=4)
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        app[FLOW_KEY] = RouterFlow(
            self.prefill, self.decode, self.store, self.metrics, session, self.settings
        )
        try:
            await self.store.ping()
        except StoreError as exc:
            log.error("%s (requests will be misses until it is reachable)", exc)
        self.checker = HealthChecker(
            [self.prefill, self.decode],
            session,
            self.settings.health_interval,
            facts=app[FLOW_KEY].facts,  # each node's block size, learned when it answers
        )
        self.checker.on_down = app[FLOW_KEY].peers.down  # POST /drop_peer to its peers
        self.checker.start()
        self.sweeper.start()
        log.info(
            "bidir-kv proxy: prefill %s, decode %s, store %s, cache TTL %.0fs, decode stream %s",
            [node.id for node in self.prefill.nodes],
            [node.id for node in self.decode.nodes],
            self.store.kind,
            self.settings.cache_ttl,
            self.settings.decode_stream,
        )

    async def on_cleanup(self, app: web.Application) -> None:
        await self.sweeper.stop()
        if self.checker is not None:
            await self.checker.stop()
        await app[FLOW_KEY].releaser.close()
        await app[FLOW_KEY].session.close()
        await self.store.close()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await request.app[FLOW_KEY].handle(request, "chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await request.app[FLOW_KEY].handle(request, "completions")

    async def health(self, request: web.Request) -> web.Response:
        prefill, decode = self.prefill, self.decode
        try:
            evicted = await self.store.sweep()
            cached = await self.store.size()
            store_ok = True
        except StoreError as exc:
            evicted, cached, store_ok = 0, 0, False
            log.error("%s", exc)
        p_ok, d_ok = bool(prefill.healthy()), bool(decode.healthy())
        everything = (
            p_ok
            and d_ok
            and len(prefill.healthy()) == len(prefill.nodes)
            and len(decode.healthy()) == len(decode.nodes)
            and store_ok
        )
        status = "ok" if everything else ("degraded" if p_ok and d_ok else "unavailable")
        body = {
            "status": status,
            "cached_conversations": cached,
            "evicted_stale": evicted,
            "store": {"kind": self.store.kind, "ok": store_ok},
            "prefill": [_node(node) for node in prefill.nodes],
            "decode": [_node(node) for node in decode.nodes],
            # what `bidir-kv doctor` checks against the engines (docs/hardware.md §5)
            "config": {
                "cache_ttl": self.settings.cache_ttl,
                "decoder_kv_blocks_ttl": self.settings.decoder_kv_blocks_ttl,
                "decode_stream": self.settings.decode_stream,
            },
        }
        return web.json_response(body, status=200 if p_ok and d_ok else 503)

    async def metrics_route(self, request: web.Request) -> web.Response:
        metrics = self.metrics
        for pool in (self.prefill, self.decode):
            for node in pool.nodes:
                metrics.healthy.labels(pool.role, node.id).set(1 if node.healthy else 0)
                metrics.inflight.labels(pool.role, node.id).set(node.inflight)
        try:
            metrics.cached.set(await self.store.size())
        except StoreError as exc:
            log.error("%s", exc)
        return web.Response(
            body=metrics.render(),
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type": "version=0.0.4"},
        )

    async def models(self, request: web.Request) -> web.StreamResponse:
        node = self.decode.pick() or self.prefill.pick()
        if node is None:
            return error_response(503, "no healthy engine to list models", "ServiceUnavailable")
        flow = request.app[FLOW_KEY]
        try:
            async with flow.session.get(f"{node.url}/v1/models") as resp:
                raw = await resp.read()
                return web.Response(status=resp.status, body=raw, content_type="application/json")
        except (aiohttp.ClientError, OSError) as exc:
            return error_response(502, f"{node.id}: {exc}", "BadGateway")


def _node(node: Upstream) -> dict[str, object]:
    return {
        "node": node.id,
        "healthy": node.healthy,
        "inflight": node.inflight,
        "error": node.last_error,
        "block_size": node.block_size,  # as learned (docs/router.md "Block size")
    }
