"""aiohttp application of ``bidir-kv proxy``: routes, lifecycle, ``/health``, ``/metrics``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from bidir_kv.router.backends import Backend, HealthChecker, Pool
from bidir_kv.router.flow import RouterConfig, RouterFlow, error_response
from bidir_kv.router.metrics import RouterMetrics
from bidir_kv.router.store import ConversationStore, StoreError, open_store

__all__ = ["AppSettings", "build_app"]

log = logging.getLogger("bidir_kv.router")

FLOW_KEY = web.AppKey("flow", RouterFlow)


@dataclass(frozen=True)
class AppSettings:
    """Everything needed to build the app (the CLI fills it from flags)."""

    prefill_hosts: Sequence[str] = ("localhost",)
    prefill_ports: Sequence[int] = (8100,)
    decode_hosts: Sequence[str] = ("localhost",)
    decode_ports: Sequence[int] = (8200,)
    store: str = "memory"
    max_conversations: int = 100_000
    health_interval: float = 2.0
    router: RouterConfig = field(default_factory=RouterConfig)


def build_app(settings: AppSettings, store: ConversationStore | None = None) -> web.Application:
    """The router app; pools and store are created here, connections on startup."""
    prefill = Pool("prefill", settings.prefill_hosts, settings.prefill_ports)
    decode = Pool("decode", settings.decode_hosts, settings.decode_ports)
    cfg = settings.router
    the_store = store or open_store(settings.store, cfg.cache_ttl, settings.max_conversations)
    metrics = RouterMetrics()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    state: dict[str, object] = {}

    async def on_startup(app: web.Application) -> None:
        # Idle upstream connections are dropped before uvicorn's (and vLLM's) 5 s
        # keep-alive closes them, so a reused connection is never a half-closed one.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=4)
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        flow = RouterFlow(prefill, decode, the_store, metrics, session, cfg)
        app[FLOW_KEY] = flow
        try:
            await the_store.ping()
        except StoreError as exc:
            log.error("%s (requests will be misses until it is reachable)", exc)
        checker = HealthChecker([prefill, decode], session, settings.health_interval)
        state["checker"] = checker
        checker.start()
        log.info(
            "bidir-kv proxy: prefill %s, decode %s, store %s, cache TTL %.0fs, decode stream %s",
            [n.id for n in prefill.nodes], [n.id for n in decode.nodes], the_store.kind,
            cfg.cache_ttl, cfg.decode_stream,
        )

    async def on_cleanup(app: web.Application) -> None:
        checker = state.get("checker")
        if isinstance(checker, HealthChecker):
            await checker.stop()
        await app[FLOW_KEY].session.close()
        await the_store.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await request.app[FLOW_KEY].handle(request, "chat/completions")

    async def completions(request: web.Request) -> web.StreamResponse:
        return await request.app[FLOW_KEY].handle(request, "completions")

    async def health(request: web.Request) -> web.Response:
        try:
            evicted = await the_store.sweep()
            cached = await the_store.size()
            store_ok = True
        except StoreError as exc:
            evicted, cached, store_ok = 0, 0, False
            log.error("%s", exc)
        p_ok, d_ok = bool(prefill.healthy()), bool(decode.healthy())
        everything = p_ok and d_ok and len(prefill.healthy()) == len(prefill.nodes) and len(
            decode.healthy()) == len(decode.nodes) and store_ok
        status = "ok" if everything else ("degraded" if p_ok and d_ok else "unavailable")
        body = {
            "status": status,
            "cached_conversations": cached,
            "evicted_stale": evicted,
            "store": {"kind": the_store.kind, "ok": store_ok},
            "prefill": [_node(n) for n in prefill.nodes],
            "decode": [_node(n) for n in decode.nodes],
        }
        return web.json_response(body, status=200 if p_ok and d_ok else 503)

    async def metrics_route(request: web.Request) -> web.Response:
        for pool in (prefill, decode):
            for n in pool.nodes:
                metrics.healthy.labels(pool.role, n.id).set(1 if n.healthy else 0)
                metrics.inflight.labels(pool.role, n.id).set(n.inflight)
        try:
            metrics.cached.set(await the_store.size())
        except StoreError as exc:
            log.error("%s", exc)
        return web.Response(body=metrics.render(),
                            content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type": "version=0.0.4"})

    async def models(request: web.Request) -> web.StreamResponse:
        node = decode.pick() or prefill.pick()
        if node is None:
            return error_response(503, "no healthy engine to list models", "ServiceUnavailable")
        flow = request.app[FLOW_KEY]
        try:
            async with flow.session.get(f"{node.url}/v1/models") as resp:
                raw = await resp.read()
                return web.Response(status=resp.status, body=raw, content_type="application/json")
        except (aiohttp.ClientError, OSError) as exc:
            return error_response(502, f"{node.id}: {exc}", "BadGateway")

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_route)
    app.router.add_get("/v1/models", models)
    return app


def _node(n: Backend) -> dict[str, object]:
    return {"node": n.id, "healthy": n.healthy, "inflight": n.inflight, "error": n.last_error}
