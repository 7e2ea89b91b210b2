"""Stopping a sweep cleanly: the first Ctrl-C finishes the requests in flight, a second aborts.

SIGTERM (a timeout, a CI cancel) unwinds like a hard Ctrl-C so that every node
a leg started is still stopped.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Sequence

from bidir_kv.bench.runner import ConversationState, PointResult, RunOptions, run_point
from bidir_kv.bench.workload import Conversation

__all__ = ["Interrupt", "run_point_interruptible", "terminate"]


class Interrupt:
    """First Ctrl-C: finish in-flight requests, write what ran, stop. Second: abort now."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.request()

    def request(self) -> None:
        if not self.requested:
            print(
                "interrupt: stopping after the requests in flight (Ctrl-C again to abort)",
                file=sys.stderr,
                flush=True,
            )
        self.requested = True


def terminate(signum: int, frame: object) -> None:
    """SIGTERM handler: unwind as a hard Ctrl-C would."""
    raise KeyboardInterrupt(f"signal {signum}")


def run_point_interruptible(
    convs: Sequence[Conversation],
    opts: RunOptions,
    leg: str,
    on_request: Callable[..., None],
    intr: Interrupt,
    *,
    upto_turn: int | None = None,
    states: dict[str, ConversationState] | None = None,
) -> PointResult:
    """Run one point; a first Ctrl-C sets the runner's stop event instead of raising.
    ``upto_turn`` and ``states``: as :func:`~bidir_kv.bench.runner.run_point`."""

    async def go() -> PointResult:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def first_sigint() -> None:
            intr.request()
            stop.set()
            loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C aborts hard

        loop.add_signal_handler(signal.SIGINT, first_sigint)
        try:
            return await run_point(
                convs,
                opts,
                leg=leg,
                on_request=on_request,
                stop=stop,
                upto_turn=upto_turn,
                states=states,
            )
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    try:
        return asyncio.run(go())
    finally:
        intr.install()
