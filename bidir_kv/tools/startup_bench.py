"""Startup benchmark: launch-to-``/health``-200 of ``bidir-kv engine`` per transport.

``python -m bidir_kv.tools.startup_bench --transport tcp nixl --runs 5`` starts one
engine at a time (so runs do not compete for the CPU), polls ``/health`` every 5 ms
and prints min/median per transport, next to the cost of a bare interpreter that only
imports the engine's dependencies, measured in the same run as the baseline.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bidir_kv.client import NodeClient, TransportError
from bidir_kv.engine.transport import TRANSPORT_CHOICES
from bidir_kv.launch.process import ManagedProcess, free_port

__all__ = ["main", "measure_once"]


def _poll(url: str, proc: ManagedProcess, timeout: float) -> None:
    deadline = time.perf_counter() + timeout
    with NodeClient(url, timeout=1) as client:
        while time.perf_counter() < deadline:
            if proc.returncode is not None:
                raise RuntimeError(f"engine exited with {proc.returncode}\n{proc.log_tail()}")
            try:
                if client.get("").status == 200:
                    return
            except TransportError:
                pass
            time.sleep(0.005)
    raise RuntimeError(f"{url} not healthy after {timeout} s\n{proc.log_tail()}")


def measure_once(transport: str, log_dir: Path) -> float:
    port, side = free_port(), free_port()
    env = {
        **os.environ,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
    }
    argv = [
        sys.executable,
        "-m",
        "bidir_kv",
        "engine",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--transport",
        transport,
    ]
    proc = ManagedProcess(f"engine-{transport}", argv, log_dir / f"{transport}-{port}.log", env)
    t0 = time.perf_counter()
    proc.start()
    try:
        _poll(f"http://127.0.0.1:{port}/health", proc, 120)
        return time.perf_counter() - t0
    finally:
        proc.stop()


def baseline_import() -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import aiohttp.web, numpy, prometheus_client"], check=True
    )
    return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bidir_kv.tools.startup_bench")
    p.add_argument("--transport", nargs="+", default=["tcp"], choices=TRANSPORT_CHOICES)
    p.add_argument("--runs", type=int, default=5)
    ns = p.parse_args(argv)
    if ns.runs < 1:
        p.error("--runs must be >= 1")
    with tempfile.TemporaryDirectory(prefix="bidir-kv-startup-") as tmp:
        base = [baseline_import() for _ in range(ns.runs)]
        print(
            f"baseline (python + import aiohttp.web, numpy, prometheus_client): "
            f"min {min(base):.3f} s, median {statistics.median(base):.3f} s"
        )
        for transport in ns.transport:
            times = [measure_once(transport, Path(tmp)) for _ in range(ns.runs)]
            med = statistics.median(times)
            print(
                f"{transport}: launch -> /health 200: min {min(times):.3f} s, median "
                f"{med:.3f} s ({med / statistics.median(base):.2f}x baseline)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
