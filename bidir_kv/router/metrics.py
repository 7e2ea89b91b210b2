"""Prometheus metrics of the router (its own registry, exposed at ``/metrics``).

vLLM has no router metrics, so the names are ours, under ``bidir_kv_router_``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["RouterMetrics"]

_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
_PREFILL_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class RouterMetrics:
    """One instance per app; counters are named by what an operator asks."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "bidir_kv_router_"
        self.requests = Counter(p + "requests", "Client requests", ["endpoint"], registry=r)
        self.hits = Counter(
            p + "cache_hits",
            "Turns whose P took D's cached tokens (P's usage.cached_tokens covered the offer)",
            registry=r,
        )
        self.hit_offers = Counter(
            p + "cache_hit_offers", "Turns sent to P with D's cached params", registry=r
        )
        self.hit_tokens = Counter(
            p + "cache_hit_tokens", "Cached tokens P reported on counted hits", registry=r
        )
        self.misses = Counter(
            p + "cache_misses",
            "Turns sent to P with the miss dict",
            ["reason"],  # no_id, not_found, stale, guard, fallback, not_pulled, ...
            registry=r,
        )
        self.stale = Counter(p + "cache_stale", "Entries found older than --cache-ttl", registry=r)
        self.history_matches = Counter(
            p + "history_matches",
            "Turns without an id that found a stored turn by their history",
            ["match"],  # exact: its whole history repeated; prefix: a shorter one
            registry=r,
        )
        self.guard_rejections = Counter(
            p + "guard_rejections",
            "Cached entries not reused because the prompt is not a provable continuation",
            ["reason"],
            registry=r,
        )
        self.prefill_verified = Counter(
            p + "prefill_verified_offers",
            "Hits sent whole to a P that reads only the prefix D's token chain proves",
            registry=r,
        )
        self.guard_trims = Counter(
            p + "guard_trims", "Hits reduced to the block-aligned common prefix", registry=r
        )
        self.fallbacks = Counter(
            p + "fallbacks",
            "Retries after a failure (reuse retried as a miss, or another node)",
            ["cause"],
            registry=r,
        )
        self.errors = Counter(
            p + "errors", "Requests that ended in an error", ["cause"], registry=r
        )
        self.stored = Counter(p + "cache_stores", "D params stored for the next turn", registry=r)
        self.not_cached = Counter(
            p + "not_cached", "Finished turns whose params were not stored", ["reason"], registry=r
        )
        self.drop_peer = Counter(
            p + "drop_peer",
            "POST /drop_peer calls to engines paired with a dead or restarted node",
            ["outcome"],
            registry=r,  # sent, unsupported (404), failed
        )
        self.client_params_dropped = Counter(
            p + "client_kv_params_dropped", "Client-supplied kv_transfer_params removed", registry=r
        )
        self.prefill_duration = Histogram(
            p + "prefill_duration_seconds",
            "Wall time of the P leg",
            ["outcome"],
            buckets=_PREFILL_BUCKETS,
            registry=r,
        )
        self.added_latency = Histogram(
            p + "added_latency_seconds",
            "Router time per request outside upstream I/O (first byte to the client)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.healthy = Gauge(
            p + "backend_healthy",
            "1 if the node passes health checks",
            ["role", "node"],
            registry=r,
        )
        self.inflight = Gauge(
            p + "backend_inflight", "Requests in flight per node", ["role", "node"], registry=r
        )
        self.releases = Counter(
            p + "releases",
            "Notify-only releases of D's blocks that P accepted (turns not stored)",
            ["reason"],  # no_id, untracked_delta, n_gt_1, store_error, client_gone, evicted, ...
            registry=r,
        )
        self.release_failures = Counter(
            p + "release_failures",
            "Releases of D's blocks not sent or refused",
            ["cause"],
            registry=r,
        )
        self._add_conversation_metrics(p, r)
        self._add_connection_metrics(p, r)
        self.cached = Gauge(p + "cached_conversations", "Live store entries", registry=r)

    def _add_connection_metrics(self, p: str, r: CollectorRegistry) -> None:
        """Client connections (bidir_kv/router/listener.py) and worker restarts."""
        self.client_connections = Gauge(
            p + "client_connections", "Client connections open", registry=r
        )
        self.connections_refused = Counter(
            p + "connections_refused",
            "Connections answered 503: at the connection bound or out of descriptors",
            registry=r,
        )
        self.header_timeouts = Counter(
            p + "header_timeouts",
            "Connections closed without a request head in --header-timeout",
            registry=r,
        )
        self.accept_failures = Counter(
            p + "accept_failures",
            "Accepts that failed for lack of descriptors or memory",
            ["errno"],
            registry=r,
        )
        self.worker_restarts = Gauge(
            p + "worker_restarts",
            "Workers the supervisor had replaced when this worker started (--workers)",
            registry=r,
        )

    def _add_conversation_metrics(self, p: str, r: CollectorRegistry) -> None:
        """The renewable lease's routes and sweep (docs/router.md "Conversation lease")."""
        self.keepalives = Counter(
            p + "conversation_keepalives",
            "Keep-alive requests (POST /v1/conversations/{id}/keepalive)",
            ["outcome"],  # renewed, no_lease, not_found
            registry=r,
        )
        self.closes = Counter(
            p + "conversation_closes",
            "Close requests (DELETE /v1/conversations/{id})",
            ["outcome"],  # closed, not_found
            registry=r,
        )
        self.lease_expiries = Counter(
            p + "lease_expiries",
            "Stored turns dropped because their lease went idle",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
