"""The ``engine-d2p`` case of ``transport_bench``: the engine's real D→P readback,
measured the way vLLM reports it: P's ``/metrics``.

Two ``bidir-kv engine`` processes (``LocalTopology``, 1P1D, no router), vLLM's request
flow per round: turn 1 (miss dict → P with ``max_tokens=1``, P's dict → D), then turn 2
on P with D's dict and a prompt that extends D's sequence. P has prefix caching off,
so it pulls D's whole retained history: with
``kv_bytes_per_token = nbytes / 1024`` that is 1024 tokens = ``nbytes`` of real KV.
The round's time is P's ``vllm:nixl_xfer_time_seconds`` delta; its bytes the
``vllm:nixl_bytes_transferred`` delta, which must equal what the flow implies.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from bidir_kv.config import KVTransferConfig
from bidir_kv.protocol import KVTransferParams
from bidir_kv.scrape import MetricsSnapshot, tokens_by_source
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.topology.base import EngineSpec, TopologySpec
from bidir_kv.topology.local import LocalTopology

__all__ = ["EngineD2P"]

HISTORY_TOKENS = 1024  # D's remote_num_tokens after turn 1
BLOCK_SIZE = 16
GENERATED = 33  # turn 1 output; prompt = HISTORY_TOKENS - GENERATED + 1
NEW_TOKENS = 16  # the user's new message in turn 2
XFER_SUM = "vllm:nixl_xfer_time_seconds_sum"
XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
BYTES_SUM = "vllm:nixl_bytes_transferred_sum"


def _kv(role: str) -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"bidirectional_kv_xfer": True},
        }
    )


def _settled(client: EngineClient, timeout: float = 10.0) -> MetricsSnapshot:
    """Scrape until the transfer counters stop moving (stats land after the response)."""
    deadline = time.monotonic() + timeout
    prev = client.metrics()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        cur = client.metrics()
        if all(cur.value(m) == prev.value(m) for m in (XFER_COUNT, BYTES_SUM)):
            return cur
        prev = cur
    return prev


class EngineD2P:
    name = "engine-d2p"

    def __init__(self, nbytes: int, workdir: Path, *, transport: str = "nixl") -> None:
        if nbytes % HISTORY_TOKENS:
            raise ValueError(f"engine-d2p needs bytes divisible by {HISTORY_TOKENS}")
        kvb = nbytes // HISTORY_TOKENS
        self.nbytes = nbytes
        self.note = (
            f"two engines ({transport}), turn 2 pulls {HISTORY_TOKENS} tokens x {kvb // 1024} "
            "KiB/token; P /metrics"
        )
        capacity = 8 * HISTORY_TOKENS  # P keeps each turn 2 under its lease for a while

        def spec(role: str, prefix_caching: bool) -> EngineSpec:
            return EngineSpec(
                kv=_kv(role),
                transport=transport,
                block_size=BLOCK_SIZE,
                enable_prefix_caching=prefix_caching,
                kv_bytes_per_token=kvb,
                kv_capacity_tokens=capacity,
                max_model_len=4 * HISTORY_TOKENS,
                profile="tiny",
            )

        spec_ = TopologySpec(prefill=spec("prefill", False), decode=spec("decode", True), routers=0)
        self.topo = LocalTopology(spec_, workdir / "engines", timeout=60.0)
        self.topo.__enter__()
        self.p = EngineClient(self.topo.prefill[0])
        self.d = EngineClient(self.topo.decode[0])
        self.rng = random.Random(2024)

    def _prompt(self, n: int) -> list[int]:
        from bidir_kv.engine.model import BYTE_BASE, VOCAB_SIZE

        return [self.rng.randrange(BYTE_BASE, VOCAB_SIZE) for _ in range(n)]

    def once(self, i: int) -> float:
        prompt1 = self._prompt(HISTORY_TOKENS - GENERATED + 1)
        p1 = self.p.complete(prompt1, 1, KVTransferParams.miss()).raise_for_status()
        if p1.params is None:
            raise RuntimeError("P returned no kv_transfer_params on turn 1")
        d1 = self.d.complete(prompt1, GENERATED, p1.params).raise_for_status()
        if d1.params is None or d1.params.num_remote_tokens != HISTORY_TOKENS:
            got = None if d1.params is None else d1.params.num_remote_tokens
            raise RuntimeError(f"D retained {got} tokens, expected {HISTORY_TOKENS}")
        prompt2 = [*prompt1, *d1.token_ids, *self._prompt(NEW_TOKENS)]
        before = _settled(self.p)
        p2 = self.p.complete(prompt2, 1, d1.params.for_prefill_hit()).raise_for_status()
        delta = _settled(self.p) - before
        if delta.value(XFER_COUNT) != 1:
            raise RuntimeError(f"P made {delta.value(XFER_COUNT):.0f} reads on turn 2, not 1")
        pulled = tokens_by_source(delta)["external_kv_transfer"]
        if pulled != HISTORY_TOKENS or delta.value(BYTES_SUM) != self.nbytes:
            raise RuntimeError(
                f"turn 2 pulled {pulled} tokens / {delta.value(BYTES_SUM):.0f} bytes, "
                f"expected {HISTORY_TOKENS} / {self.nbytes}"
            )
        if len(p2.token_ids) != 1:
            raise RuntimeError(f"P's turn 2 produced {len(p2.token_ids)} tokens")
        return delta.value(XFER_SUM)

    def close(self) -> None:
        self.topo.close()
