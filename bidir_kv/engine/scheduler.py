"""The engine core: the step loop, the reader and the owner, assembled and run.

Protocol decisions follow vLLM 0.33 as described in docs/protocol.md and go through
:mod:`bidir_kv.policy`; moving bytes is the :class:`ConnectorWorker`'s job. The
three parts (``steps.py``, ``reader.py``, ``owner.py``) share the block manager and
the metrics; this module wires them, owns the background tasks and is the surface
the HTTP routes call.

Deliberate differences from vLLM (docs/engine.md): a P with bidirectional mode off
ignores D's params instead of waiting forever (suspected defect 2); a declined or
failed read under ``recompute`` recomputes once and never re-queues a read (defect
1); blocks are paired by position unless ``kv_pairing="suffix-trim"`` (defect 3).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from bidir_kv.engine.compute import ModelRunner
from bidir_kv.engine.connector import ConnectorWorker
from bidir_kv.engine.groups import GroupTables
from bidir_kv.engine.kvcache import BlockManager
from bidir_kv.engine.metrics import EngineMetrics
from bidir_kv.engine.owner import HandleOwner
from bidir_kv.engine.reader import PullReader
from bidir_kv.engine.request import Request, RequestError
from bidir_kv.engine.settings import EngineSettings, Pairing
from bidir_kv.engine.steps import StepLoop
from bidir_kv.wire.ids import EngineId, RequestId
from bidir_kv.wire.params import HeldTokens

__all__ = ["EngineCore", "Pairing", "Request", "RequestError"]

logger = logging.getLogger("bidir_kv.engine")
_HOUSEKEEPING_PERIOD = 0.1  # seconds between expiry sweeps


class EngineCore:
    """All engine state, driven by one asyncio task (the step loop)."""

    def __init__(
        self,
        settings: EngineSettings,
        blocks: BlockManager,
        worker: ConnectorWorker,
        metrics: EngineMetrics,
    ) -> None:
        self.settings = settings
        self.blocks = blocks
        self.worker = worker
        self.metrics = metrics
        self.clock = worker.clock
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        layout = settings.group_layout
        groups = GroupTables(layout, blocks) if len(layout) > 1 else None
        runner = ModelRunner(blocks, groups)
        self.owner = HandleOwner(settings, blocks, worker, metrics, wake=self._wake, groups=groups)
        self.reader = PullReader(
            settings, worker, runner, metrics, spawn=self._spawn, host=self, groups=groups
        )
        self.steps = StepLoop(
            settings, blocks, runner, metrics, reader=self.reader, owner=self.owner
        )
        metrics.watch_memory(blocks.usage, self.owner.retained_share)

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self.steps.run())
        self._spawn(self._housekeeping())

    async def close(self) -> None:
        for t in [self._loop_task, *self._tasks]:
            if t is not None:
                t.cancel()
        for t in [self._loop_task, *self._tasks]:
            if t is not None:
                with contextlib.suppress(BaseException):  # shutdown: nobody to report to
                    await t

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _wake(self) -> None:
        self.steps.wake.set()

    async def _housekeeping(self) -> None:
        last_log = time.perf_counter()
        while True:
            await asyncio.sleep(_HOUSEKEEPING_PERIOD)
            self.owner.reap(self.clock())
            self.steps.expire_waiting(time.perf_counter())
            if time.perf_counter() - last_log >= self.settings.metrics_log_interval:
                last_log = time.perf_counter()
                window = self.metrics.take_window()
                if not window.empty():
                    logger.info("%s", window.log_line())

    # ---- the reader's host (PullHost) ----------------------------------------------

    def run_locally(self, req: Request, hit: int, external: int) -> None:
        self.steps.run_locally(req, hit, external)

    def finish(self, req: Request, reason: str) -> None:
        self.steps.finish(req, reason)

    def received(self, resolve: Callable[[], None]) -> None:
        self.steps.received(resolve)

    # ---- what the HTTP routes call -------------------------------------------------

    def new_request_id(self, prefix: str, base: str | None) -> str:
        return self.steps.new_request_id(prefix, base)

    def submit(self, req: Request) -> Request:
        """Validate and queue a request (raises :class:`RequestError` for a 400)."""
        return self.steps.submit(req)

    def abort(self, req: Request) -> None:
        """The client went away: finish as ``abort`` (no retention, no params)."""
        self.steps.abort(req)

    async def on_notification(self, peer: str, message: bytes) -> None:
        await self.owner.on_notification(peer, message)

    def claim(
        self, request_id: RequestId, blocks: list[int], reader: EngineId | None = None
    ) -> str | None:
        """Grant single-use access to a held handle; return a refusal reason or None."""
        return self.owner.claim(request_id, blocks, reader)

    def drop_peer(self, engine_id: str) -> dict[str, int]:
        """``POST /drop_peer`` (vLLM PR #56341): a paired engine is gone. Abort the
        requests whose params name it (queued or reading from it), free the handles it
        claimed and will never report read, and forget its handshake."""
        named = [
            req
            for req in (*self.steps.waiting, *self.reader.reading)
            if req.params is not None and req.params.remote_engine_id == engine_id
        ]
        for req in named:
            self.steps.abort(req)
        return {
            "aborted": len(named),
            "freed_blocks": self.owner.drop_reader(engine_id),
            "peers_dropped": self.worker.drop_engine(engine_id),
        }

    def handle_tokens(self, request_id: RequestId) -> HeldTokens | None:
        return self.owner.handle_tokens(request_id)

    def usage_cached_tokens(self, req: Request) -> int:
        return req.usage_cached_tokens()

    def stall_reason(self) -> str | None:
        """Why ``/health`` should fail: the step loop made no progress while work ran."""
        limit = self.settings.health_stall_seconds
        stalled = self.steps.stalled_for(time.perf_counter())
        if limit <= 0 or stalled < limit:
            return None
        return (
            f"scheduler stalled: no step for {stalled:.1f} s with "
            f"{len(self.steps.running)} request(s) running (--health-stall-seconds {limit:g})"
        )

    def assert_idle(self) -> dict[str, int]:
        """Counts of what is still held (the suites' ``assert_scheduler_empty``)."""
        return {
            "waiting": len(self.steps.waiting),
            "running": len(self.steps.running),
            "pulling": self.reader.num_pulling,  # READs in flight or not yet taken back
            "received": self.steps.num_received,  # READs over, waiting for the next step
            **self.owner.held(),
            "free_blocks": self.blocks.num_free,
            "usable_blocks": self.blocks.num_usable_blocks,
        }
