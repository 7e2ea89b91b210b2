"""Transfer benchmark: our KV agents (and the engine's D→P path) against a raw NIXL READ.

``python -m bidir_kv.engine.transport.bench`` measures, in one run and on the same
machine state:

* ``raw-nixl``: a bare two-process NIXL/UCX DRAM READ of ``--mib`` MiB, the recipe of
  cpu-vllm.md §6.2 (target in a child process, tight polling in the initiator);
* ``agent-nixl`` / ``agent-tcp``: ``KVAgent.read()`` of the same bytes from an owner
  process found through the side channel, as the engine calls it;
* ``engine-d2p`` (when the engine is available, ``--engine``): two ``bidir-kv engine``
  processes, a turn 1 then a turn 2 carrying ~``--mib`` MiB of history, with the bytes
  and time of the D→P read taken from P's ``/metrics`` deltas.

Every iteration's bytes are verified by SHA-256. Output: GB/s (median and best) and
each case's ratio to the raw NIXL median. It is a command, not a test: numbers depend
on the machine and are never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bidir_kv.engine.transport import KVPool, create_agent, nixl_available
from bidir_kv.engine.transport.peer import seeded_pool_bytes, spawn
from bidir_kv.engine.transport.sidechannel import handshake

__all__ = ["CaseResult", "main"]

MiB = 1024 * 1024


@dataclass
class CaseResult:
    case: str
    nbytes: int
    seconds: list[float] = field(default_factory=list)
    note: str = ""
    error: str = ""

    @property
    def gbps(self) -> list[float]:
        return [self.nbytes / s / 1e9 for s in self.seconds if s > 0]

    @property
    def median_gbps(self) -> float:
        return statistics.median(self.gbps) if self.seconds else 0.0


def _sha(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def bench_raw_nixl(nbytes: int, iters: int, workdir: Path) -> CaseResult:
    """cpu-vllm.md §6.2: initializer READ of one region, polled in a tight loop."""
    from bidir_kv.engine.transport.nixl import _nixl_api

    res = CaseResult("raw-nixl", nbytes, note="bare nixl_agent, 1 descriptor, tight poll")
    target = spawn(["raw-target", "--nbytes", str(nbytes), "--seed", "7"], workdir / "raw")
    try:
        api = _nixl_api()
        agent = api.nixl_agent("raw-initiator", api.nixl_agent_config(backends=["UCX"]))
        remote = agent.add_remote_agent(target.ready["agent_md"])
        remote_descs = agent.deserialize_descs(target.ready["descs"])
        buf = np.ones(nbytes, dtype=np.uint8)  # touched: no page faults inside the timing
        region = np.array([[buf.ctypes.data, nbytes, 0]], dtype=np.uint64)
        reg = agent.register_memory(region, "DRAM")
        local_descs = agent.get_xfer_descs(region, "DRAM")
        handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote, b"raw:1")
        try:
            for i in range(iters + 1):  # iteration 0 warms the connection up
                buf[:] = 0
                t0 = time.perf_counter()
                state = agent.transfer(handle)
                while state == "PROC":
                    state = agent.check_xfer_state(handle)
                dt = time.perf_counter() - t0
                if state != "DONE":
                    raise RuntimeError(f"raw READ ended in state {state}")
                if _sha(buf) != target.ready["sha256"]:
                    raise RuntimeError(f"raw READ iteration {i} delivered wrong bytes")
                if i:
                    res.seconds.append(dt)
        finally:
            agent.release_xfer_handle(handle)
            agent.deregister_memory(reg)
            agent.remove_remote_agent(remote)
    finally:
        target.stop()
    return res


async def _agent_reads(
    backend: str, num_blocks: int, block_nbytes: int, iters: int, workdir: Path
) -> CaseResult:
    nbytes = num_blocks * block_nbytes
    res = CaseResult(
        f"agent-{backend}",
        nbytes,
        note=f"KVAgent.read of {num_blocks} x {block_nbytes // 1024} KiB blocks, side channel",
    )
    owner = spawn(
        [
            "owner", "--backend", backend, "--num-blocks", str(num_blocks),
            "--block-nbytes", str(block_nbytes), "--seed", "11",
        ],
        workdir / f"owner-{backend}",
    )  # fmt: skip
    expected = _sha(seeded_pool_bytes(11, num_blocks, block_nbytes))
    pool = KVPool(np.ones((num_blocks, block_nbytes), dtype=np.uint8))
    agent = create_agent(backend, f"bench-reader-{backend}", pool)
    try:
        await agent.start(lambda _peer, _msg: None)
        info = await handshake(
            "127.0.0.1",
            owner.ready["side_channel_port"],
            local_hash=owner.ready["compat_hash"],
            backend=backend,
        )
        peer = await agent.add_peer(info.meta.agent_metadata)
        blocks = list(range(num_blocks))
        for i in range(iters + 1):
            pool.data[:] = 0
            t0 = time.perf_counter()
            await agent.read(peer, blocks, blocks, f"bench-{i}:1".encode())
            dt = time.perf_counter() - t0
            if _sha(pool.data) != expected:
                raise RuntimeError(f"{backend} read iteration {i} delivered wrong bytes")
            if i:
                res.seconds.append(dt)
    finally:
        await agent.close()
        owner.stop()
    return res


def bench_agent(
    backend: str, num_blocks: int, block_nbytes: int, iters: int, workdir: Path
) -> CaseResult:
    return asyncio.run(_agent_reads(backend, num_blocks, block_nbytes, iters, workdir))


def _guarded(name: str, nbytes: int, fn: Callable[..., CaseResult], *args: object) -> CaseResult:
    try:
        return fn(*args)
    except Exception as exc:
        return CaseResult(name, nbytes, error=f"{type(exc).__name__}: {exc}")


def _engine_case(nbytes: int, iters: int, workdir: Path) -> CaseResult:
    if importlib.util.find_spec("bidir_kv.topology.local") is None:
        raise RuntimeError("the emulated engine is not available (no bidir_kv.topology.local)")
    raise RuntimeError("the engine D->P case is not wired up in this build")


def render(results: Sequence[CaseResult]) -> str:
    raw = next((r for r in results if r.case == "raw-nixl" and r.seconds), None)
    base = raw.median_gbps if raw else 0.0
    lines = [
        f"{'case':<12} {'MiB':>6} {'n':>3} {'median GB/s':>12} {'best GB/s':>10} "
        f"{'vs raw':>7}  note"
    ]
    for r in results:
        if r.error:
            lines.append(f"{r.case:<12} {r.nbytes / MiB:>6.0f}   -  failed: {r.error}")
            continue
        ratio = f"{r.median_gbps / base:>6.0%}" if base else "     -"
        lines.append(
            f"{r.case:<12} {r.nbytes / MiB:>6.0f} {len(r.seconds):>3} {r.median_gbps:>12.2f} "
            f"{max(r.gbps):>10.2f} {ratio:>7}  {r.note}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bidir_kv.engine.transport.bench",
        description="KV transfer bandwidth of our transports vs a raw NIXL READ, same run.",
    )
    ap.add_argument("--mib", type=int, default=64, help="bytes per transfer, MiB (default 64)")
    ap.add_argument("--block-kib", type=int, default=1024, help="agent block size (KiB)")
    ap.add_argument("--iters", type=int, default=5, help="timed iterations per case")
    ap.add_argument(
        "--cases",
        default="raw-nixl,agent-nixl,agent-tcp,engine-d2p",
        help="comma-separated subset of raw-nixl,agent-nixl,agent-tcp,engine-d2p",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write results as JSON")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - {"raw-nixl", "agent-nixl", "agent-tcp", "engine-d2p"}
    if unknown:
        ap.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    block_nbytes = args.block_kib * 1024
    nbytes = args.mib * MiB
    if nbytes % block_nbytes:
        ap.error("--mib must be a multiple of --block-kib")
    num_blocks = nbytes // block_nbytes
    ok, why = nixl_available()
    results: list[CaseResult] = []
    with tempfile.TemporaryDirectory(prefix="bidir-kv-bench-") as tmp:
        work = Path(tmp)
        for case in cases:
            print(f"... {case}", file=sys.stderr, flush=True)
            if case in ("raw-nixl", "agent-nixl") and not ok:
                results.append(CaseResult(case, nbytes, error=f"nixl unavailable: {why}"))
            elif case == "raw-nixl":
                results.append(_guarded(case, nbytes, bench_raw_nixl, nbytes, args.iters, work))
            elif case.startswith("agent-"):
                backend = case.removeprefix("agent-")
                results.append(
                    _guarded(
                        case,
                        nbytes,
                        bench_agent,
                        backend,
                        num_blocks,
                        block_nbytes,
                        args.iters,
                        work,
                    )
                )
            else:
                results.append(_guarded(case, nbytes, _engine_case, nbytes, args.iters, work))
    print(render(results))
    if args.json:
        payload = [asdict(r) | {"median_gbps": r.median_gbps} for r in results]
        args.json.write_text(json.dumps(payload, indent=2))
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
