"""``--hw-launch``: the hardware tier starts P and D on this runner with ``bidir-kv serve``.

Both nodes run on one host with their own accelerator sets (``--hw-p-gpus``,
``--hw-d-gpus``), HTTP ports 8100/8200 and side-channel ports 5600/5601 (one host needs
two), with the recipe's flags (docs/hardware.md §1) and P's prefix cache off. They are
stopped through their pidfiles when the tier's module ends, even when it fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.launch.pidfile import launch, stop
from bidir_kv.serve.command import ServeSpec, build
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.topology.base import Node

__all__ = ["launch_pair"]


def _spec(config: pytest.Config, role: str, model: str) -> ServeSpec:
    opt = config.getoption
    return ServeSpec(
        role="prefill" if role == "prefill" else "decode", model=model,
        cold_prefill=True, host="127.0.0.1", ip="127.0.0.1",
        side_channel_port=5600 if role == "prefill" else 5601,
        tp=int(opt("--hw-tp")), nixl_backend=str(opt("--hw-nixl-backend")),
        device=opt("--hw-device"), kv_rank=0 if role == "prefill" else 1, kv_parallel_size=2,
        kv_recompute_threshold=int(opt("--hw-threshold")),
        visible=str(opt("--hw-p-gpus") if role == "prefill" else opt("--hw-d-gpus")),
        extra_args=tuple(opt("--hw-launch-arg")),
    )


def launch_pair(
    config: pytest.Config, run_dir: Path
) -> tuple[EngineClient, EngineClient, dict[str, Any], Callable[[], None]]:
    """(P client, D client, description, close) of the started pair."""
    model = config.getoption("--hw-launch-model")
    if not model:
        raise pytest.UsageError("--hw-launch needs --hw-launch-model")
    specs = [_spec(config, role, str(model)) for role in ("prefill", "decode")]
    pidfiles = [run_dir / f"{s.role}-{s.http_port}.pid" for s in specs]

    def close() -> None:
        for pidfile in pidfiles:
            with contextlib.suppress(OSError, ValueError):
                stop(pidfile, timeout=60)

    try:
        records = [launch(build(s), role=s.role, url=f"http://127.0.0.1:{s.http_port}",
                          log_path=run_dir / f"{s.role}-{s.http_port}.log", pidfile=pf,
                          health_timeout=1800, wait=False) for s, pf in zip(specs, pidfiles,
                                                                            strict=True)]
        from bidir_kv.launch.process import wait_http_ok

        for rec in records:
            wait_http_ok(rec.url + "/health", 1800)
    except BaseException:
        close()
        raise
    nodes = [Node(role=s.role, name=s.role, host="127.0.0.1", port=s.http_port,
                  log_path=r.log) for s, r in zip(specs, records, strict=True)]
    served = config.getoption("--hw-model") or str(model)
    return (EngineClient(nodes[0], model=served, timeout=600),
            EngineClient(nodes[1], model=served, timeout=600),
            {"model": model, "commands": [list(r.argv) for r in records]}, close)
