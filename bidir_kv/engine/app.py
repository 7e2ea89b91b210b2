"""Assemble one engine (pool, transport, side channel, scheduler, HTTP) and run it."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiohttp import web

from bidir_kv.config import KVTransferConfig
from bidir_kv.engine.connector import ConnectorWorker
from bidir_kv.engine.faults import Faults
from bidir_kv.engine.kvcache import BlockManager
from bidir_kv.engine.metrics import EngineMetrics
from bidir_kv.engine.model import Tokenizer
from bidir_kv.engine.profiles import CostProfile
from bidir_kv.engine.scheduler import EngineCore, EngineOptions, Pairing
from bidir_kv.engine.server import Routes, build_app
from bidir_kv.engine.transport import KVPool, create_agent
from bidir_kv.engine.transport.sidechannel import compatibility_hash

__all__ = ["EngineSettings", "run_engine"]

logger = logging.getLogger("bidir_kv.engine")


@dataclass
class EngineSettings:
    model: str
    served_names: list[str]
    host: str
    port: int
    kv: KVTransferConfig
    profile: CostProfile
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_model_len: int = 32768
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    kv_bytes_per_token: int = 64
    num_layers: int = 2
    kv_capacity_tokens: int = 262144
    transport: str = "auto"
    emulate_vllm: str = "0.33"
    kv_pairing: Pairing = "position"
    side_host: str = "localhost"
    side_port: int = 5600
    metrics_log_interval: float = 10.0
    kv_verify: bool = True
    kv_guard: bool = True
    faults: Faults = field(default_factory=Faults)


async def run_engine(s: EngineSettings, stop: asyncio.Event) -> None:
    bs = s.block_size
    num_blocks = s.kv_capacity_tokens // bs + 1  # + the null block 0
    pool = KVPool.allocate(num_blocks, bs * s.kv_bytes_per_token)
    blocks = BlockManager(pool, bs, s.num_layers, s.enable_prefix_caching)
    agent = create_agent(s.transport, s.kv.engine_id, pool, host=s.side_host)
    compat = compatibility_hash(
        {
            "model": s.model,
            "block_size": bs,
            "kv_bytes_per_token": s.kv_bytes_per_token,
            "num_layers": s.num_layers,
            "vllm": s.emulate_vllm,
        }
    )
    profile = s.profile
    worker = ConnectorWorker(
        engine_id=s.kv.engine_id,
        agent=agent,
        side_host=s.side_host,
        side_port=s.side_port,
        block_size=bs,
        compat_hash=compat,
        enforce_compat=s.kv.enforce_handshake_compat,
        faults=s.faults,
        transfer_floor=profile.transfer_seconds,
    )
    metrics = EngineMetrics(s.served_names[0])
    opts = EngineOptions(
        model_name=s.served_names[0],
        block_size=bs,
        enable_prefix_caching=s.enable_prefix_caching,
        max_model_len=s.max_model_len,
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_num_seqs=s.max_num_seqs,
        kv_capacity_tokens=s.kv_capacity_tokens,
        kv_pairing=s.kv_pairing,
        emulate_vllm=s.emulate_vllm,
        side_host=s.side_host,
        metrics_log_interval=s.metrics_log_interval,
        kv_verify=s.kv_verify,
        kv_guard=s.kv_guard,
    )
    core = EngineCore(opts, s.kv, profile, blocks, worker, metrics, s.faults)
    routes = Routes(core, Tokenizer(), s.served_names, s.model, s.faults)
    runner = web.AppRunner(build_app(routes), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, s.host, s.port)
        await site.start()
        await worker.start(core.on_notification, http_port=_bound_port(runner, s.port))
        core.start()
        routes.ready = True
        logger.info("Creating v1 connector with name: NixlPullConnector")
        line = s.kv.startup_log_line()
        if line:
            logger.info("%s", line)
        logger.info(
            "Engine %s (%s transport, side channel %s:%d, %d blocks of %d tokens, "
            "emulating vLLM %s) ready",
            s.kv.engine_id,
            agent.backend,
            s.side_host,
            worker.side_port,
            num_blocks - 1,
            bs,
            s.emulate_vllm,
        )
        logger.info("Starting vLLM API server on http://%s:%d", s.host, _bound_port(runner, s.port))
        await stop.wait()
    finally:
        await core.close()
        await worker.close()
        await runner.cleanup()


def _bound_port(runner: web.AppRunner, default: int) -> int:
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            return int(server.sockets[0].getsockname()[1])
    return default
