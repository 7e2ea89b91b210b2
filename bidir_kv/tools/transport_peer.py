"""A stand-alone block owner in its own process, for benchmarks and two-process tests.

Roles (``python -m bidir_kv.tools.transport_peer ROLE ...``):

* ``raw-target``: a bare NIXL agent owning one seeded buffer, exactly the target of
  docs/vllm-cpu.md §6.2; publishes agent metadata and serialized descriptors in a file.
* ``raw-tcp-target``: the same buffer served over plain blocking TCP (the loopback
  ceiling for the TCP transport);
* ``owner``: one of our agents (``--transport tcp|nixl``) owning a seeded pool, behind a
  real side channel; every notification it receives is appended to ``notifs.log``.

Both write ``ready.msgpack`` atomically (temp name, then rename) and run until SIGTERM,
then deregister and exit 0. Pool contents come from ``--seed``, so a reader can
recompute exactly what it should have received.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from bidir_kv.engine.transport import wire
from bidir_kv.launch.process import ManagedProcess, ProcessFailed

__all__ = ["READY", "PeerProcess", "main", "seeded_pool_bytes", "spawn", "write_atomic"]

READY = "ready.msgpack"
NOTIFS = "notifs.log"


def seeded_pool_bytes(seed: int, num_blocks: int, block_nbytes: int) -> np.ndarray:
    """The deterministic content of a peer's pool: ``(num_blocks, block_nbytes)`` uint8."""
    raw = np.random.default_rng(seed).bytes(num_blocks * block_nbytes)
    return np.frombuffer(raw, dtype=np.uint8).reshape(num_blocks, block_nbytes).copy()


def write_atomic(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(msgpack.packb(obj, use_bin_type=True))
    os.replace(tmp, path)


def _raw_target(args: argparse.Namespace) -> int:
    from bidir_kv.engine.transport.nixl import nixl_api

    api = nixl_api()
    conf = api.nixl_agent_config(enable_prog_thread=args.prog_thread, backends=["UCX"])
    agent = api.nixl_agent("raw-target", conf)
    buf = seeded_pool_bytes(args.seed, 1, args.nbytes).reshape(-1)
    region = np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64)
    reg = agent.register_memory(region, "DRAM")
    descs = agent.get_xfer_descs(region, "DRAM")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _s, _f: stop.set())
    write_atomic(
        Path(args.dir) / READY,
        {
            "agent_md": agent.get_agent_metadata(),
            "descs": agent.get_serialized_descs(descs),
            "sha256": hashlib.sha256(buf.tobytes()).hexdigest(),
            "pid": os.getpid(),
        },
    )
    # As the recipe's target does, poll for notifications; without a progress thread
    # this is also what lets UCX accept the initiator's connection.
    while not stop.wait(0.001):
        agent.get_new_notifs()
    agent.deregister_memory(reg)
    return 0


def _raw_tcp_target(args: argparse.Namespace) -> int:
    """Serve one seeded buffer over plain blocking TCP: each byte received asks for it all."""
    import socket

    buf = seeded_pool_bytes(args.seed, 1, args.nbytes).reshape(-1)
    lsock = socket.create_server(("127.0.0.1", 0))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def serve() -> None:
        while True:
            conn, _ = lsock.accept()
            with conn:
                while conn.recv(1):
                    conn.sendall(buf.data)

    threading.Thread(target=serve, daemon=True).start()
    write_atomic(
        Path(args.dir) / READY,
        {
            "port": lsock.getsockname()[1],
            "sha256": hashlib.sha256(buf.tobytes()).hexdigest(),
            "pid": os.getpid(),
        },
    )
    signal.sigwait({signal.SIGTERM})
    return 0


async def _owner(args: argparse.Namespace) -> int:
    from bidir_kv.engine.transport import KVPool, create_agent
    from bidir_kv.engine.transport.sidechannel import (
        EngineMetadata,
        SideChannelServer,
        compatibility_hash,
    )

    pool = KVPool(seeded_pool_bytes(args.seed, args.num_blocks, args.block_nbytes))
    agent = create_agent(args.transport, f"owner-{args.engine_id}", pool)
    log = open(Path(args.dir) / NOTIFS, "a", buffering=1)  # noqa: SIM115 - closed below

    def on_notification(peer: str, message: bytes) -> None:
        log.write(f"{peer}\t{message.decode(errors='replace')}\n")

    await agent.start(on_notification)
    chash = compatibility_hash({"block_nbytes": args.block_nbytes})
    server = SideChannelServer(
        "127.0.0.1",
        0,
        lambda: EngineMetadata(
            engine_id=args.engine_id,
            compat_hash=chash,
            backend=agent.backend,
            agent_metadata=agent.metadata(),
            block_size=16,
            block_nbytes=pool.block_nbytes,
            num_blocks=pool.num_blocks,
        ),
    )
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    write_atomic(
        Path(args.dir) / READY,
        {
            "side_channel_port": server.port,
            "compat_hash": chash,
            "transport": agent.backend,
            "sha256": hashlib.sha256(pool.data.tobytes()).hexdigest(),
            "pid": os.getpid(),
        },
    )
    try:
        await stop.wait()
    finally:
        await server.close()
        await agent.close()
        log.close()
    return 0


class PeerProcess:
    """A running peer process and what it published in its ready file."""

    def __init__(self, proc: ManagedProcess, ready: dict[str, Any], workdir: Path) -> None:
        self.proc = proc
        self.ready = ready
        self.dir = workdir

    def notifications(self) -> list[tuple[str, str]]:
        path = self.dir / NOTIFS
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [(a, b) for a, _, b in (line.partition("\t") for line in lines)]

    def stop(self) -> int | None:
        return self.proc.stop()


def spawn(role_args: Sequence[str], workdir: Path, *, timeout: float = 60.0) -> PeerProcess:
    """Start ``peer ROLE ...`` with ``--dir workdir`` and wait for its ready file.

    The process is stopped again if it dies or is not ready within ``timeout``.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    ready_path = workdir / READY
    argv = [
        sys.executable,
        "-m",
        "bidir_kv.tools.transport_peer",
        *role_args,
        "--dir",
        str(workdir),
    ]
    proc = ManagedProcess(f"peer-{role_args[0]}", argv, workdir / "peer.log").start()
    deadline = time.monotonic() + timeout
    delay = 0.01
    try:
        while not ready_path.exists():
            if proc.returncode is not None:
                raise ProcessFailed(f"peer exited with {proc.returncode}\n{proc.log_tail()}")
            if time.monotonic() > deadline:
                raise ProcessFailed(f"peer not ready after {timeout} s\n{proc.log_tail()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)
        ready = msgpack.unpackb(ready_path.read_bytes(), raw=False)
    except BaseException:
        proc.stop()
        raise
    return PeerProcess(proc, ready, workdir)


def _exit_with_parent() -> None:
    """Stop (SIGTERM to ourselves) when the process that spawned us is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bidir_kv.tools.transport_peer")
    sub = ap.add_subparsers(dest="role", required=True)
    raw = sub.add_parser("raw-target", help="bare NIXL target (docs/vllm-cpu.md §6.2)")
    raw.add_argument("--dir", required=True)
    raw.add_argument("--nbytes", type=int, required=True)
    raw.add_argument("--seed", type=int, default=0)
    raw.add_argument("--prog-thread", action="store_true", help="NIXL progress thread on")
    rtcp = sub.add_parser("raw-tcp-target", help="one buffer over plain blocking TCP")
    rtcp.add_argument("--dir", required=True)
    rtcp.add_argument("--nbytes", type=int, required=True)
    rtcp.add_argument("--seed", type=int, default=0)
    own = sub.add_parser("owner", help="one of our agents behind a side channel")
    own.add_argument("--dir", required=True)
    own.add_argument(
        "--transport", "--backend", dest="transport", choices=(wire.TCP, wire.NIXL), required=True
    )
    own.add_argument("--num-blocks", type=int, required=True)
    own.add_argument("--block-nbytes", type=int, required=True)
    own.add_argument("--seed", type=int, default=0)
    own.add_argument("--engine-id", default="owner")
    args = ap.parse_args(argv)
    _exit_with_parent()
    if args.role == "raw-target":
        return _raw_target(args)
    if args.role == "raw-tcp-target":
        return _raw_tcp_target(args)
    return asyncio.run(_owner(args))


if __name__ == "__main__":
    sys.exit(main())
