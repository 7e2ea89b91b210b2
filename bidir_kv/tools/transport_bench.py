"""Transfer benchmark: our KV agents (and the engine's D→P path) against a raw NIXL READ.

``python -m bidir_kv.tools.transport_bench`` measures, in one run:

* ``raw-nixl``: a bare two-process NIXL/UCX DRAM READ of ``--mib`` MiB, the recipe of
  docs/vllm-cpu.md §6.2 (target in a child process, tight polling in the initiator);
* ``raw-nixl-pt``: the same with NIXL's progress thread on in both processes, as the
  recipe has it (our agents run without it; see docs/transports.md);
* ``raw-tcp``: the same bytes over a plain blocking loopback socket (the ceiling for
  the TCP transport, which copies twice where CMA copies once);
* ``agent-nixl`` / ``agent-tcp``: ``KVAgent.read()`` of the same bytes from an owner
  process found through the side channel, as the engine calls it;
* ``engine-d2p``: two ``bidir-kv engine`` processes, a turn 1 then a turn 2 carrying
  ~``--mib`` MiB of history; the D→P read's bytes and time come from P's ``/metrics``
  deltas (``vllm:nixl_bytes_transferred``, ``vllm:nixl_xfer_time_seconds``).

All cases are set up first, then measured in interleaved rounds (one transfer of each
case per round), so a change in machine load hits every case alike. Every transfer's
bytes are verified (SHA-256, or the engine's own KV-content check). Output: median and
best GB/s and each median's ratio to the raw NIXL median. It is a command, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from bidir_kv.engine.transport import KVPool, create_agent, nixl_available, wire
from bidir_kv.engine.transport.sidechannel import handshake
from bidir_kv.tools.transport_peer import PeerProcess, seeded_pool_bytes, spawn

__all__ = ["CASES", "CaseResult", "main"]

MiB = 1024 * 1024
CASES = ("raw-nixl", "raw-nixl-pt", "raw-tcp", "agent-nixl", "agent-tcp", "engine-d2p")
DEFAULT_CASES = tuple(c for c in CASES if c != "raw-nixl-pt")


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


class Case(Protocol):
    name: str
    note: str
    nbytes: int

    def once(self, i: int) -> float:
        """One verified transfer; seconds it took."""
        ...

    def close(self) -> None: ...


def _sha(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


class RawNixl:
    """docs/vllm-cpu.md §6.2: one region, ``initialize_xfer`` READ, tight ``check_xfer_state``.

    ``raw-nixl`` runs both agents without NIXL's progress thread (the tight poll drives
    UCX; fastest on a small shared machine, so the strictest baseline); ``raw-nixl-pt``
    is the recipe verbatim, progress thread on.
    """

    def __init__(self, nbytes: int, workdir: Path, *, prog_thread: bool = False) -> None:
        from bidir_kv.engine.transport.nixl import nixl_api

        self.name = "raw-nixl-pt" if prog_thread else "raw-nixl"
        self.note = "bare nixl_agent, 1 descriptor, tight poll" + (
            ", progress thread" if prog_thread else ""
        )
        self.nbytes = nbytes
        flags = ["--prog-thread"] if prog_thread else []
        self.target: PeerProcess = spawn(
            ["raw-target", "--nbytes", str(nbytes), "--seed", "7", *flags], workdir / self.name
        )
        api = nixl_api()
        conf = api.nixl_agent_config(enable_prog_thread=prog_thread, backends=["UCX"])
        self.agent = api.nixl_agent(f"{self.name}-initiator", conf)
        self.remote = self.agent.add_remote_agent(self.target.ready["agent_md"])
        remote_descs = self.agent.deserialize_descs(self.target.ready["descs"])
        self.buf = np.ones(nbytes, dtype=np.uint8)  # touched: no page faults while timed
        region = np.array([[self.buf.ctypes.data, nbytes, 0]], dtype=np.uint64)
        self.reg = self.agent.register_memory(region, "DRAM")
        local_descs = self.agent.get_xfer_descs(region, "DRAM")
        self.handle = self.agent.initialize_xfer(
            "READ", local_descs, remote_descs, self.remote, b"raw:1"
        )

    def once(self, i: int) -> float:
        self.buf[:] = 0
        t0 = time.perf_counter()
        state = self.agent.transfer(self.handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(self.handle)
        dt = time.perf_counter() - t0
        if state != "DONE":
            raise RuntimeError(f"raw READ ended in state {state}")
        if _sha(self.buf) != self.target.ready["sha256"]:
            raise RuntimeError(f"raw READ {i} delivered wrong bytes")
        return dt

    def close(self) -> None:
        try:
            self.agent.release_xfer_handle(self.handle)
            self.agent.deregister_memory(self.reg)
            self.agent.remove_remote_agent(self.remote)
        finally:
            self.target.stop()


class RawTcp:
    """Loopback ceiling: blocking ``recv_into`` of the whole buffer from another process."""

    name = "raw-tcp"
    note = "plain blocking socket, recv_into, no framing"

    def __init__(self, nbytes: int, workdir: Path) -> None:
        import socket

        self.nbytes = nbytes
        self.target = spawn(
            ["raw-tcp-target", "--nbytes", str(nbytes), "--seed", "7"], workdir / "raw-tcp"
        )
        self.buf = np.ones(nbytes, dtype=np.uint8)
        self.sock = socket.create_connection(("127.0.0.1", self.target.ready["port"]))

    def once(self, i: int) -> float:
        self.buf[:] = 0
        view = memoryview(self.buf.data)
        t0 = time.perf_counter()
        self.sock.sendall(b"r")
        got = 0
        while got < self.nbytes:
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise RuntimeError("raw TCP target closed the connection")
            got += n
        dt = time.perf_counter() - t0
        if _sha(self.buf) != self.target.ready["sha256"]:
            raise RuntimeError(f"raw TCP {i} delivered wrong bytes")
        return dt

    def close(self) -> None:
        self.sock.close()
        self.target.stop()


class AgentRead:
    """``KVAgent.read()`` of every block of an owner process, peer found by handshake."""

    def __init__(self, transport: str, nbytes: int, block_nbytes: int, workdir: Path) -> None:
        self.name = f"agent-{transport}"
        self.nbytes = nbytes
        n = nbytes // block_nbytes
        self.note = f"KVAgent.read of {n} x {block_nbytes // 1024} KiB blocks"
        self.blocks = list(range(n))
        self.runner = asyncio.Runner()
        self.owner = spawn(
            [
                "owner",
                "--transport",
                transport,
                "--num-blocks",
                str(n),
                "--block-nbytes",
                str(block_nbytes),
                "--seed",
                "11",
            ],
            workdir / self.name,
        )
        self.expected = _sha(seeded_pool_bytes(11, n, block_nbytes))
        self.pool = KVPool(np.ones((n, block_nbytes), dtype=np.uint8))
        self.agent = create_agent(transport, f"bench-reader-{transport}", self.pool)
        self.peer = self.runner.run(self._connect(transport))

    async def _connect(self, transport: str) -> str:
        await self.agent.start(lambda _peer, _msg: None)
        info = await handshake(
            "127.0.0.1",
            self.owner.ready["side_channel_port"],
            local_hash=self.owner.ready["compat_hash"],
            backend=transport,
        )
        return await self.agent.add_peer(info.meta.agent_metadata)

    def once(self, i: int) -> float:
        self.pool.data[:] = 0

        async def timed() -> float:
            t0 = time.perf_counter()
            await self.agent.read(self.peer, self.blocks, self.blocks, f"bench-{i}:1".encode())
            return time.perf_counter() - t0

        dt = self.runner.run(timed())
        if _sha(self.pool.data) != self.expected:
            raise RuntimeError(f"{self.name} read {i} delivered wrong bytes")
        return dt

    def close(self) -> None:
        try:
            self.runner.run(self.agent.close())
            self.runner.close()
        finally:
            self.owner.stop()


def _make(name: str, nbytes: int, block_nbytes: int, workdir: Path, args: Any) -> Case:
    if name in ("raw-nixl", "raw-nixl-pt"):
        return RawNixl(nbytes, workdir, prog_thread=name == "raw-nixl-pt")
    if name == "raw-tcp":
        return RawTcp(nbytes, workdir)
    if name.startswith("agent-"):
        return AgentRead(name.removeprefix("agent-"), nbytes, block_nbytes, workdir)
    from bidir_kv.tools.engine_d2p import EngineD2P

    return EngineD2P(nbytes, workdir, transport=args.engine_transport)


def run_cases(
    names: Sequence[str], nbytes: int, block_nbytes: int, iters: int, workdir: Path, args: Any
) -> list[CaseResult]:
    """Set every case up, then ``iters`` interleaved rounds after one warm-up round."""
    ok, why = nixl_available()
    results = {n: CaseResult(n, nbytes) for n in names}
    live: dict[str, Case] = {}
    with ExitStack() as stack:
        for n in names:
            if (
                n in ("raw-nixl", "agent-nixl")
                or (n == "engine-d2p" and args.engine_transport == "nixl")
            ) and not ok:
                results[n].error = f"nixl unavailable: {why}"
                continue
            print(f"... setting up {n}", file=sys.stderr, flush=True)
            try:
                case = _make(n, nbytes, block_nbytes, workdir, args)
            except Exception as exc:
                results[n].error = f"setup: {type(exc).__name__}: {exc}"
                continue
            stack.callback(case.close)
            live[n] = case
            results[n].note = case.note
            results[n].nbytes = case.nbytes
        for i in range(iters + 1):
            print(f"... round {i}{' (warm-up)' if i == 0 else ''}", file=sys.stderr, flush=True)
            for n, case in list(live.items()):
                try:
                    dt = case.once(i)
                except Exception as exc:
                    results[n].error = f"round {i}: {type(exc).__name__}: {exc}"
                    del live[n]
                    continue
                if i:
                    results[n].seconds.append(dt)
    return [results[n] for n in names]


def render(results: Sequence[CaseResult]) -> str:
    """The table: medians compared with the raw median, bests with the raw best."""
    raw = next((r for r in results if r.case == "raw-nixl" and r.seconds), None)
    base = raw.median_gbps if raw else 0.0
    base_best = max(raw.gbps) if raw else 0.0
    lines = [
        f"{'case':<12} {'MiB':>6} {'n':>3} {'median GB/s':>12} {'best GB/s':>10} "
        f"{'median/raw':>10} {'best/raw':>9}  note"
    ]
    for r in results:
        if r.error:
            lines.append(f"{r.case:<12} {r.nbytes / MiB:>6.1f}   -  failed: {r.error}")
            continue
        best = max(r.gbps)
        ratio = f"{r.median_gbps / base:.0%}" if base else "-"
        ratio_best = f"{best / base_best:.0%}" if base_best else "-"
        lines.append(
            f"{r.case:<12} {r.nbytes / MiB:>6.1f} {len(r.seconds):>3} {r.median_gbps:>12.2f} "
            f"{best:>10.2f} {ratio:>10} {ratio_best:>9}  {r.note}"
        )
    return "\n".join(lines)


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bidir_kv.tools.transport_bench",
        description="KV transfer bandwidth of our transports vs a raw NIXL READ, same run.",
    )
    ap.add_argument("--mib", type=int, default=64, help="bytes per transfer, MiB (default 64)")
    ap.add_argument("--block-kib", type=int, default=1024, help="agent block size (KiB)")
    ap.add_argument("--iters", type=int, default=5, help="timed rounds (after one warm-up)")
    ap.add_argument(
        "--cases",
        default=",".join(DEFAULT_CASES),
        help=f"comma-separated subset of {','.join(CASES)} (default: all but raw-nixl-pt, "
        "whose progress threads would load the other cases)",
    )
    ap.add_argument(
        "--engine-transport",
        choices=(wire.NIXL, wire.TCP),
        default=wire.NIXL,
        help="transport of the two engines in engine-d2p",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write results as JSON")
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(names) - set(CASES)
    if unknown:
        ap.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    if args.mib <= 0 or args.block_kib <= 0 or args.iters <= 0:
        ap.error("--mib, --block-kib and --iters must be positive")
    block_nbytes = args.block_kib * 1024
    nbytes = args.mib * MiB
    if nbytes % block_nbytes:
        ap.error("--mib must be a multiple of --block-kib")
    # `timeout` and CI send SIGTERM: unwind so every child process is stopped.
    load_before = os.getloadavg()[0]
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        with tempfile.TemporaryDirectory(prefix="bidir-kv-bench-") as tmp:
            results = run_cases(names, nbytes, block_nbytes, args.iters, Path(tmp), args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    ok, why = nixl_available()
    print(
        f"{os.cpu_count()} CPUs, 1-min load average {load_before:.1f} -> "
        f"{os.getloadavg()[0]:.1f}; {why if ok else 'no nixl: ' + why}"
    )
    print(render(results))
    if args.json:
        payload = [asdict(r) | {"median_gbps": r.median_gbps} for r in results]
        args.json.write_text(json.dumps(payload, indent=2))
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
