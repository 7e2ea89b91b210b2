"""Assemble one engine (pool, transport, side channel, scheduler, HTTP) and run it."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from bidir_kv.engine.connector import ConnectorWorker
from bidir_kv.engine.fencewords import fence_from_config
from bidir_kv.engine.hf_tokenizer import HFTokenizer
from bidir_kv.engine.kvcache import BlockManager
from bidir_kv.engine.metrics import EngineMetrics, cache_config_labels
from bidir_kv.engine.model import Tokenizer
from bidir_kv.engine.scheduler import EngineCore
from bidir_kv.engine.server import Routes, build_app
from bidir_kv.engine.settings import EngineSettings
from bidir_kv.engine.transport import KVPool, create_agent
from bidir_kv.engine.transport.sidechannel import compatibility_hash

__all__ = ["EngineSettings", "run_engine"]

logger = logging.getLogger("bidir_kv.engine")


def _worker(settings: EngineSettings, pool: KVPool) -> ConnectorWorker:
    """The transport agent and side channel, with the compatibility hash peers check."""
    side_host, side_port = settings.side_channel()
    tp = settings.tensor_parallel_size
    agent = create_agent(
        settings.transport, settings.kv.engine_id, pool.rank_rows(tp), host=side_host
    )
    compat = compatibility_hash(
        {
            "model": settings.model,
            "block_size": settings.block_size,
            "kv_bytes_per_token": settings.effective_kv_bytes_per_token,
            "num_layers": settings.num_layers,
            "vllm": settings.emulate_vllm,
            # a peer of another group layout would pair blocks of other layers
            **({"kv_cache_groups": settings.kv_cache_groups} if hybrid(settings) else {}),
        }
    )
    fence = fence_from_config(settings.kv.extra, pinned=settings.retained_blocks == "pin")
    if fence is not None:
        agent.attach_fence(fence.words)
    return ConnectorWorker(
        fence=fence,
        engine_id=settings.kv.engine_id,
        agent=agent,
        side_host=side_host,
        side_port=side_port,
        block_size=settings.block_size,
        compat_hash=compat,
        enforce_compat=settings.kv.enforce_handshake_compat,
        faults=settings.faults,
        transfer_floor=settings.profile.transfer_seconds,
        tp_size=tp,
    )


def hybrid(settings: EngineSettings) -> bool:
    """Several KV cache groups (engine/groups.py)."""
    return len(settings.group_layout) > 1


async def run_engine(settings: EngineSettings, stop: asyncio.Event) -> None:
    bs = settings.block_size
    # several groups: each block holds one group's share of the layers, so the same
    # memory holds as many blocks as tokens times groups (vLLM's hybrid manager)
    groups = len(settings.group_layout)
    num_blocks = settings.kv_capacity_tokens // bs * groups + 1  # + the null block 0
    pool = KVPool.allocate(num_blocks, bs * settings.effective_kv_bytes_per_token // groups)
    caching = settings.enable_prefix_caching and groups == 1
    blocks = BlockManager(pool, bs, settings.num_layers // groups, caching)
    worker = _worker(settings, pool)
    metrics = EngineMetrics(settings.model_name, ranks=settings.tensor_parallel_size)
    metrics.cache_config(
        cache_config_labels(
            block_size=bs,
            enable_prefix_caching=settings.enable_prefix_caching,
            num_blocks=num_blocks - 1,
            kv_bytes_per_token=settings.effective_kv_bytes_per_token,
            max_model_len=settings.max_model_len,
        )
    )
    core = EngineCore(settings, blocks, worker, metrics)
    tokenizer = Tokenizer() if settings.tokenizer is None else HFTokenizer(settings.tokenizer)
    routes = Routes(core, tokenizer, settings.served_names, settings.model, settings.faults)
    runner = web.AppRunner(build_app(routes), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        try:
            await site.start()
        except OSError as exc:
            raise OSError(
                f"HTTP server cannot listen on {settings.host}:{settings.port}: "
                f"{exc.strerror or exc}"
            ) from None
        await worker.start(core.on_notification, http_port=_bound_port(runner, settings.port))
        core.start()
        routes.ready = True
        _log_ready(settings, worker, num_blocks, _bound_port(runner, settings.port))
        await stop.wait()
    finally:
        await core.close()
        await worker.close()
        await runner.cleanup()


def _log_ready(
    settings: EngineSettings, worker: ConnectorWorker, num_blocks: int, http_port: int
) -> None:
    logger.info("Creating v1 connector with name: NixlPullConnector")
    line = settings.kv.startup_log_line()
    if line:
        logger.info("%s", line)
    logger.info(
        "Engine %s (%s transport, side channel %s:%d, %d blocks of %d tokens, "
        "emulating vLLM %s) ready",
        settings.kv.engine_id,
        worker.agent.backend,
        worker.side_host,
        worker.side_port,
        num_blocks - 1,
        settings.block_size,
        settings.emulate_vllm,
    )
    allow = settings.kv.peer_allowlist
    if allow is None:
        logger.info(
            "bidir_kv_peer_allowlist is unset: KV is read from any peer that "
            "kv_transfer_params name (vLLM's behaviour)"
        )
    else:
        logger.info("Peer allowlist: KV is read only from %s", allow.describe())
    for note in emulation_notes(settings, worker.agent.backend):
        logger.info("%s", note)
    logger.info("Starting vLLM API server on http://%s:%d", settings.host, http_port)


def emulation_notes(settings: EngineSettings, backend: str) -> list[str]:
    """One line per recipe setting that is accepted but emulated by something else."""
    notes = []
    kv = settings.kv
    tp = settings.tensor_parallel_size
    if tp > 1:
        notes.append(
            f"tensor_parallel_size={tp}: emulating {tp} ranks in one process; KV per rank "
            f"{settings.effective_kv_bytes_per_token // tp} of "
            f"{settings.effective_kv_bytes_per_token} bytes/token; a pull moves {tp} per-rank "
            f"descriptor sets in one READ over one transport agent; peers must run TP {tp}"
        )
    if kv.kv_buffer_device != "cpu":
        notes.append(
            f"kv_buffer_device={kv.kv_buffer_device!r}: emulated; the KV pool is host memory"
        )
    if hybrid(settings):
        notes.append(
            f"kv_cache_groups={settings.kv_cache_groups}: {len(settings.group_layout)} KV cache "
            "groups, each block holding one group's layers; the prefix cache is not "
            "emulated with several groups (off)"
        )
    if list(kv.backends) != ["UCX"]:
        notes.append(f"NIXL backends {list(kv.backends)}: emulated; KV moves over {backend}")
    return notes


def _bound_port(runner: web.AppRunner, default: int) -> int:
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            return int(server.sockets[0].getsockname()[1])
    return default
