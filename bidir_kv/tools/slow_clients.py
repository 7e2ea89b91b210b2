"""Ordinary turns beside a flood of slow clients: a measurement, not a test.

``python -m bidir_kv.tools.slow_clients [--flood 500] [--concurrency 4] [--duration 10]``
starts the router benchmark's stub P and D engines and one ``bidir-kv proxy``, runs
closed-loop multi-turn chat conversations for ``--duration`` seconds on an idle
router, then again while ``--flood`` connections each drip a partial request head
(one byte a second, never the blank line; reconnecting when the router closes them at
its ``--header-timeout``), and prints p50/p99 turn latency, throughput and errors of
both runs and how many flood connections the router held and closed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bidir_kv.client import scrape
from bidir_kv.launch.process import ManagedProcess
from bidir_kv.testing.poll import wait_for
from bidir_kv.tools.router_bench import HOST, Cell, _start_all, run_cell

__all__ = ["main"]

_PARTIAL = b"POST /v1/chat/completions HTTP/1.1\r\nHost: flood\r\nX-Slow: "


async def _slow_client(port: int, stop: asyncio.Event, closed: list[int]) -> None:
    """One connection at a time, dripping a request head that never ends."""
    while not stop.is_set():
        try:
            _, writer = await asyncio.open_connection(HOST, port)
        except OSError:
            await asyncio.sleep(0.5)  # pacing: the router is refusing, try again
            continue
        try:
            for i in range(10_000):
                writer.write(_PARTIAL[i : i + 1] if i < len(_PARTIAL) else b"a")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
                if stop.is_set():
                    break
        except OSError:
            closed[0] += 1
        finally:
            writer.close()


def _row(name: str, cell: Cell) -> str:
    return (
        f"{name:<22} turns {len(cell.latencies):>6}  p50 {cell.pct(0.5) * 1e3:7.2f} ms  "
        f"p99 {cell.pct(0.99) * 1e3:7.2f} ms  {cell.rps:7.1f} turns/s  errors {cell.errors}"
    )


async def _measure(url: str, port: int, args: argparse.Namespace) -> None:
    idle = await run_cell("router", url, args.concurrency, args.duration, args.warmup)
    print(_row("idle", idle), flush=True)
    stop, closed = asyncio.Event(), [0]
    flood = [asyncio.create_task(_slow_client(port, stop, closed)) for _ in range(args.flood)]
    try:

        def open_now() -> float | None:
            n = scrape(url).value("bidir_kv_router_client_connections")
            return n if n >= args.flood else None

        held = await asyncio.to_thread(
            wait_for, open_now, 60, f"{args.flood} slow connections held"
        )
        print(f"router holds {held:.0f} client connections", flush=True)
        busy = await run_cell("router", url, args.concurrency, args.duration, args.warmup)
    finally:
        stop.set()
        await asyncio.gather(*flood, return_exceptions=True)
    print(_row(f"beside {args.flood} slow", busy), flush=True)
    snap = scrape(url)
    print(
        f"header timeouts {snap.value('bidir_kv_router_header_timeouts_total'):.0f}, "
        f"refused {snap.value('bidir_kv_router_connections_refused_total'):.0f}, "
        f"flood connections closed by the router {closed[0]}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bidir_kv.tools.slow_clients",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--flood", type=int, default=500, help="slow connections at once")
    ap.add_argument("--concurrency", type=int, default=4, help="ordinary conversations")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds measured per run")
    ap.add_argument("--warmup", type=float, default=1.0)
    args = ap.parse_args(argv)
    procs: list[ManagedProcess] = []
    with tempfile.TemporaryDirectory(prefix="slow-clients-") as tmp:
        try:
            targets = _start_all(["router"], Path(tmp), procs, {})
            url = targets["router"]
            asyncio.run(_measure(url, int(url.rsplit(":", 1)[1]), args))
        finally:
            for proc in reversed(procs):
                proc.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
