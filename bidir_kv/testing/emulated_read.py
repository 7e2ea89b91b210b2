"""One D->P read between emulated engines, with counters read around it: the fabric
gate's evidence on this machine and its negative control.

:func:`node_spec` is a node as ``bidir-kv serve`` describes it; :class:`LocalNodes` starts
such nodes here (the ``local`` launcher: one host, no fabric); :func:`measured_read`
makes turn 1 through P and D, then turn 2's prefill on P with D's params — the D->P
read — and returns the counters' deltas around that prefill and the KV bytes the read
had to move (the mechanism gate's expectation, checked against NIXL's count).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

from bidir_kv.client import run_pd_turn, settled_metrics
from bidir_kv.fabric.counters import deltas
from bidir_kv.launch.process import ManagedProcess, wait_http_ok
from bidir_kv.policy import blocks_for_tokens
from bidir_kv.scrape import NIXL_BYTES, TOKENS_BY_SOURCE
from bidir_kv.serve.command import ServeSpec
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.testing.two_hosts import emulator_command
from bidir_kv.topology.base import Node

__all__ = [
    "BLOCK",
    "EMULATOR",
    "KV_BYTES_PER_TOKEN",
    "LocalNodes",
    "client",
    "measured_read",
    "node_spec",
]

BLOCK = 16
KV_BYTES_PER_TOKEN = 4096
EMULATOR = ("--transport", "tcp", "--kv-bytes-per-token", str(KV_BYTES_PER_TOKEN))
_VOCAB = (10, 1000)  # ordinary token ids of the emulator's tiny model


def node_spec(role: str, ip: str, host: str, port: int, side: int) -> ServeSpec:
    """An emulated node as the builder sees it: ``ip`` is its side-channel address."""
    return ServeSpec(
        role="prefill" if role == "prefill" else "decode",
        model="tiny",
        ip=ip,
        host=host,
        port=port,
        side_channel_port=side,
        block_size=BLOCK,
        max_model_len=8192,
        cold_prefill=True,
        kv_rank=0 if role == "prefill" else 1,
        kv_parallel_size=2,
        device="cpu",
    )


def client(role: str, host: str, port: int, log: Path | None = None) -> EngineClient:
    return EngineClient(
        Node(
            role="prefill" if role == "prefill" else "decode",
            name=role,
            host=host,
            port=port,
            log_path=str(log) if log else None,
        )
    )


class LocalNodes:
    """Emulated nodes started on this host; ``close()`` stops every one."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: list[ManagedProcess] = []

    def start(self, spec: ServeSpec) -> EngineClient:
        cmd = emulator_command(spec, *EMULATOR)
        log = self.run_dir / f"{spec.role}-{spec.http_port}.log"
        proc = ManagedProcess(spec.role, cmd.argv, log, env={**os.environ, **cmd.env})
        self.procs.append(proc)
        proc.start()
        wait_http_ok(f"http://{spec.host}:{spec.http_port}/health", 60, alive=proc)
        return client(spec.role, spec.host, spec.http_port, log)

    def close(self) -> None:
        for proc in self.procs:
            proc.stop()


def measured_read(
    p: EngineClient,
    d: EngineClient,
    counters_of: Callable[[], dict[str, int]],
    seed: str,
    history: int = 2000,
) -> tuple[dict[str, int], int]:
    """(counter deltas around the D->P read, KV bytes it moved); see the module docstring."""
    rng = random.Random(seed)
    prompt = [rng.randrange(*_VOCAB) for _ in range(history)]
    turn1 = run_pd_turn(p, d, prompt, 8)
    assert turn1.d is not None and turn1.d.ok and turn1.d.params is not None, (
        turn1.p.error,
        turn1.d,
    )
    prompt2 = [*turn1.sequence, *[rng.randrange(*_VOCAB) for _ in range(150)]]
    metrics_before = settled_metrics(p)
    before = counters_of()
    out = p.complete(prompt2, 1, turn1.d.params.for_prefill_hit())
    assert out.ok, out.error
    delta = settled_metrics(p) - metrics_before
    after = counters_of()
    pulled = int(delta.value(TOKENS_BY_SOURCE, source="external_kv_transfer"))
    expected = blocks_for_tokens(pulled, BLOCK) * BLOCK * KV_BYTES_PER_TOKEN
    moved = delta.value(NIXL_BYTES)
    assert pulled >= history - BLOCK and moved == expected, (pulled, moved, expected)
    if out.params is not None:
        d.complete(prompt2, 1, out.params)
    return deltas(before, after), expected
