"""The fault campaign: operational events, each judged by what a client sees next.

Per fault: what the client saw while (or right after) it happened, whether the next
turn of a conversation that lived through it is correct (oracle), and whether
serving recovered without restarting anything else: a fresh two-turn conversation
answers correctly and its second turn is a counted hit, within ``RECOVERY_SECONDS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bidir_kv.campaign.client import Clients, Conversation, body
from bidir_kv.campaign.deploy import Deployment, children
from bidir_kv.campaign.wave import WavePlan, WaveResult, counted_hits, run_wave
from bidir_kv.client import ClientError, get_json, scrape
from bidir_kv.launch.process import process_running, process_state

__all__ = ["FAULTS", "FaultResult", "run_faults"]

RECOVERY_SECONDS = 30.0
# what a row says when its fault did not happen (the same words as the test tiers'
# bidir_kv.testing.faults, which this layer cannot import): the row then fails
NOT_APPLIED = "fault did not take effect"
EFFECT_SECONDS = 10.0  # how long a fault's effect (a process gone, stopped) may take
SLOW_CLIENTS = 200  # connections dripping a request head during the slow-clients fault
REDIS_PAUSE_S = 3.0
HEALTHY = "bidir_kv_router_backend_healthy"
FAILED_READS = "vllm:nixl_num_failed_transfers_total"
OPENING, NEW, GEN = 160, 24, 8


@dataclass
class FaultResult:
    name: str
    saw: str  # what the client saw
    next_correct: bool | None  # None: not tried
    recovered: bool | None
    expected: bool = True  # what the client saw is what the fault should give
    seconds: float = 0.0
    wave: WaveResult | None = None  # d-full: what the wave cost (campaign/wave.py)

    @property
    def holds(self) -> bool:
        return self.expected and self.next_correct is not False and self.recovered is not False


class Ctx:
    """One session, the deployment, and conversation helpers for the fault steps."""

    def __init__(self, dep: Deployment, clients: Clients, wave: WavePlan | None = None) -> None:
        self.dep, self.clients = dep, clients
        self.wave = wave or WavePlan()
        self.n = 0

    def conv(self, tag: str, cid: bool = True) -> Conversation:
        self.n += 1
        return Conversation(
            f"fault-{tag}-{self.n}-{time.time_ns()}" if cid else None,
            random.Random(f"{tag}-{self.n}"),
        )

    async def turn(self, conv: Conversation, new: int = NEW, gen: int = GEN) -> Any:
        return await conv.turn(self.clients, self.dep.router_url, self.dep.reference_url, new, gen)

    async def warm(self, tag: str) -> Conversation:
        conv = self.conv(tag)
        for new in (OPENING, NEW):
            t = await self.turn(conv, new)
            if t.status != 200:
                raise RuntimeError(f"{tag}: warm-up turn failed: {t.status} {t.error}")
        return conv

    async def next_correct(self, conv: Conversation) -> bool:
        t = await self.turn(conv)
        return t.status == 200 and t.correct is not False

    def failed_reads(self) -> float:
        """READs that failed on every engine (a D still reading a dead P's memory
        recomputes, so the client never notices; this counter does)."""
        return sum(
            scrape(u).value(FAILED_READS) for u in [*self.dep.prefill_urls, *self.dep.decode_urls]
        )

    async def recovered(self) -> bool:
        """A fresh two-turn conversation: correct, its second turn a hit, no READ failed."""
        deadline = time.monotonic() + RECOVERY_SECONDS
        while time.monotonic() < deadline:
            conv = self.conv("recovery")
            f0 = self.failed_reads()
            first = await self.turn(conv, OPENING)
            h0 = self.hits()
            second = await self.turn(conv)
            hit = self.hits() > h0
            if (
                first.status == second.status == 200
                and first.correct is not False
                and second.correct is not False
                and hit
                and self.failed_reads() == f0
            ):
                return True
            await asyncio.sleep(0.5)
        return False

    def hits(self) -> float:
        """Counted hits: the router's, or P's READs when several workers each answer a
        scrape for themselves only."""
        return counted_hits(self.dep)

    async def router_sees_healthy(self, timeout: float = 15.0) -> float | None:
        """Seconds until the router's health checks pass every node again; ``None`` if not."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            snap = scrape(self.dep.router_url)
            values = [v for (name, _), v in snap.samples.items() if name == HEALTHY]
            if values and all(v == 1 for v in values):
                return time.monotonic() - t0
            await asyncio.sleep(0.1)
        return None

    def faults(self, url: str, **changes: Any) -> bool:
        return self.dep.set_faults(url, **changes)

    def state(self, url: str) -> dict[str, int]:
        out: dict[str, int] = get_json(url + "/_emulator/state")
        return out


async def _until(condition: Callable[[], bool]) -> bool:
    """Poll ``condition`` until it holds (True) or EFFECT_SECONDS pass (False)."""
    deadline = time.monotonic() + EFFECT_SECONDS
    while not condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _not_applied(name: str, what: str) -> FaultResult:
    """The row of a fault that did not happen: it fails (nothing was judged)."""
    return FaultResult(name, f"{NOT_APPLIED}: {what}", None, None, expected=False)


async def _restart(ctx: Ctx, role: str) -> FaultResult:
    name = f"{'P' if role == 'prefill' else 'D'} restarted (same engine id)"
    if not ctx.dep.local:
        return FaultResult(name, "not tried (external deployment)", None, None)
    conv = await ctx.warm(role)
    # in this thread: a child is tied to the thread that started it
    old, new = ctx.dep.restart(role)
    if old is None or process_running(old):
        return _not_applied(name, f"the old process (pid {old}) still runs")
    if new is None or new == old or not process_running(new):
        return _not_applied(name, f"no new process runs (pid {new})")
    seen = await ctx.router_sees_healthy()
    t = await ctx.turn(conv)
    saw = (
        t.seen
        + ("" if t.correct is not False else ", wrong answer")
        + (
            "; router never saw it healthy"
            if seen is None
            else f" (router saw it healthy {seen:.1f} s after it was up)"
        )
    )
    nxt = t.status == 200 and t.correct is not False and await ctx.next_correct(conv)
    return FaultResult(name, saw, nxt, await ctx.recovered(), expected=t.status == 200)


async def p_restarted(ctx: Ctx) -> FaultResult:
    return await _restart(ctx, "prefill")


async def d_restarted(ctx: Ctx) -> FaultResult:
    return await _restart(ctx, "decode")


async def d_stalled(ctx: Ctx) -> FaultResult:
    name = "D stalled (no scheduler steps)"
    d = ctx.dep.decode_urls[0]
    conv = await ctx.warm("stall")
    if not ctx.faults(d, stall=True):
        return FaultResult(name, "not tried (no fault endpoint)", None, None)
    try:
        reported = get_json(d + "/_emulator/faults").get("stall")
        if reported is not True:
            return _not_applied(
                name, f"D reports stall={reported!r} after being asked for stall=True"
            )
        t = await ctx.turn(conv)
    finally:
        ctx.faults(d, stall=False)
    seen = await ctx.router_sees_healthy()
    saw = f"{t.seen} after {t.elapsed:.1f} s" + (
        "; router never saw D healthy again"
        if seen is None
        else f"; D healthy again {seen:.1f} s after the stall ended"
    )
    return FaultResult(
        name,
        saw,
        await ctx.next_correct(conv),
        await ctx.recovered(),
        expected=t.status in (503, 504),
    )


async def d_filled(ctx: Ctx) -> FaultResult:
    """Big turns nobody continues, retained on D beyond its capacity, with new
    conversations and continuing ones around them (campaign/wave.py)."""
    plan = ctx.wave
    name = f"retained blocks fill D ({plan.big_turns} x {plan.big_tokens:,}-token turns)"
    conv = await ctx.warm("fill")
    ctx.n += 1
    wave = await run_wave(ctx.dep, ctx.clients, plan, f"fill-{ctx.n}")
    saw = f"{wave.answered}/{len(wave.turns())} HTTP 200; {summary(wave)}"
    return FaultResult(
        name,
        saw,
        await ctx.next_correct(conv),
        await ctx.recovered(),
        expected=wave.all_answered,
        wave=wave,
    )


def summary(w: WaveResult) -> str:
    """One line: new conversations' TTFT, how many waited or failed, the reuse kept."""

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    rate = "-" if w.hit_rate is None else f"{w.hit_rate:.0%}"
    return (
        f"new conversations' TTFT p50/p90/max {s(w.ttft(0.5))}/{s(w.ttft(0.9))}/"
        f"{s(w.ttft(1.0))} s, {w.waited} waited, {w.failed} failed; "
        f"continuing turns hit {rate}"
    )


async def burst_without_ids(ctx: Ctx) -> FaultResult:
    name = "burst of 32 turns without ids (1k tokens)"
    conv = await ctx.warm("burst")
    d = ctx.dep.decode_urls[0]
    before = ctx.state(d).get("retained", 0) if ctx.dep.local else 0

    async def one(i: int) -> int:
        c = ctx.conv(f"burst-{i}", cid=False)
        t = await ctx.turn(c, 1000)
        return t.status if t.correct is not False else -1

    statuses = await asyncio.gather(*(one(i) for i in range(32)))
    freed: bool | None = None
    if ctx.dep.local:  # D frees each no-id turn's blocks at once (notify-only release)
        deadline = time.monotonic() + 10
        freed = False
        while time.monotonic() < deadline and not freed:
            freed = ctx.state(d).get("retained", 0) <= before
            await asyncio.sleep(0.1)
    ok = statuses.count(200)
    saw = f"{ok}/32 HTTP 200 and correct" + (
        "" if freed is None else f", D released them: {'yes' if freed else 'no'}"
    )
    return FaultResult(
        name,
        saw,
        await ctx.next_correct(conv),
        await ctx.recovered(),
        expected=ok == 32 and freed is not False,
    )


async def client_gone(ctx: Ctx) -> FaultResult:
    """The client reads the first streamed chunk of a slow answer, then disconnects."""
    name = "client gone mid-stream"
    d = ctx.dep.decode_urls[0]
    conv = await ctx.warm("gone")
    if not ctx.faults(d, stall_seconds=0.05):
        return FaultResult(name, "not tried (no fault endpoint)", None, None)
    try:
        prompt = conv.next_prompt(NEW)
        router = ctx.clients(ctx.dep.router_url)
        got_first = False
        async with router.open_stream("/v1/completions", body(prompt, 400, conv.cid)) as data:
            async for payload in data:  # leave after the first chunk
                got_first = payload.startswith(b"{")
                break
        idle = await _wait_idle(ctx, d) if ctx.dep.local else None
    finally:
        ctx.faults(d, stall_seconds=0.0)
    saw = ("first chunk, then left" if got_first else "no chunk") + (
        "" if idle is None else f"; D's request aborted: {'yes' if idle else 'no'}"
    )
    return FaultResult(
        name,
        saw,
        await ctx.next_correct(conv),
        await ctx.recovered(),
        expected=got_first and idle is not False,
    )


async def _wait_idle(ctx: Ctx, url: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = ctx.state(url)
        if s.get("running", 0) == 0 and s.get("waiting", 0) == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def _drip(host: str, port: int, stop: asyncio.Event) -> None:
    """One slow client: a request head a byte a second, never finished."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: campaign\r\nX-Slow: "
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError:
        return
    try:
        for i in range(3600):
            writer.write(head[i : i + 1] if i < len(head) else b"a")
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            if stop.is_set():
                return
    except OSError:
        return  # the router closed it (its header timeout): what it should do
    finally:
        writer.close()


async def slow_clients(ctx: Ctx) -> FaultResult:
    """SLOW_CLIENTS connections drip partial request heads while a conversation goes on."""
    name = f"{SLOW_CLIENTS} slow clients (partial request heads)"
    conv = await ctx.warm("slow")
    host, _, port = ctx.dep.router_url.removeprefix("http://").rpartition(":")
    stop = asyncio.Event()
    flood = [
        asyncio.create_task(_drip(host, int(port.split("/")[0]), stop)) for _ in range(SLOW_CLIENTS)
    ]
    try:
        turns = [await ctx.turn(conv) for _ in range(3)]
    finally:
        stop.set()
        await asyncio.gather(*flood, return_exceptions=True)
    ok = sum(t.status == 200 and t.correct is not False for t in turns)
    slowest = max(t.elapsed for t in turns)
    saw = f"{ok}/3 turns HTTP 200 and correct beside them, slowest {slowest:.1f} s"
    return FaultResult(
        name, saw, await ctx.next_correct(conv), await ctx.recovered(), expected=ok == 3
    )


async def worker_killed(ctx: Ctx) -> FaultResult:
    """SIGKILL to one router worker (the router runs with --workers and its pid is known)."""
    name = "router worker killed (SIGKILL)"
    pid = ctx.dep.router_pid
    workers = children(pid) if pid is not None else []
    if pid is None or ctx.dep.router_workers < 2 or len(workers) < 2:
        return FaultResult(
            name, "not tried (needs a router with --workers >= 2 and its pid)", None, None
        )
    conv = await ctx.warm("worker")
    victim = min(workers)
    os.kill(victim, signal.SIGKILL)
    if not await _until(lambda: not process_running(victim)):
        return _not_applied(name, f"worker {victim} still runs {EFFECT_SECONDS:g} s after SIGKILL")
    turns = [await ctx.turn(conv) for _ in range(3)]
    deadline = time.monotonic() + 15
    replaced = False
    while time.monotonic() < deadline and not replaced:
        now = children(pid)
        replaced = len(now) >= len(workers) and victim not in now
        await asyncio.sleep(0.1)
    ok = sum(t.status == 200 and t.correct is not False for t in turns)
    # a kept-alive connection the client held to the killed worker is cut: no answer on
    # it (never an HTTP error), and the client's next connection goes to a live worker
    cut = sum(t.status is None for t in turns)
    last_ok = turns[-1].status == 200 and turns[-1].correct is not False
    saw = (
        f"{ok}/3 turns HTTP 200 and correct after it ({cut} cut with its connection); "
        f"worker replaced: {'yes' if replaced else 'no'}"
    )
    return FaultResult(
        name,
        saw,
        await ctx.next_correct(conv),
        await ctx.recovered(),
        expected=ok + cut == 3 and last_ok and replaced,
    )


async def redis_paused(ctx: Ctx) -> FaultResult:
    """The router's Redis stops answering for REDIS_PAUSE_S (SIGSTOP, then SIGCONT)."""
    name = f"Redis paused {REDIS_PAUSE_S:g} s"
    pid = ctx.dep.redis_pid()
    if pid is None:
        return FaultResult(name, "not tried (no Redis store this campaign started)", None, None)
    conv = await ctx.warm("redis")
    os.kill(pid, signal.SIGSTOP)
    try:
        if not await _until(lambda: process_state(pid) == "T"):
            return _not_applied(
                name,
                f"Redis (pid {pid}) is in state {process_state(pid)}, "
                f"not stopped, {EFFECT_SECONDS:g} s after SIGSTOP",
            )
        resume = asyncio.get_running_loop().call_later(REDIS_PAUSE_S, os.kill, pid, signal.SIGCONT)
        try:
            t = await ctx.turn(conv)
        finally:
            resume.cancel()
    finally:
        os.kill(pid, signal.SIGCONT)
    if not await _until(lambda: process_state(pid) != "T"):
        return _not_applied(
            name, f"Redis (pid {pid}) is still stopped {EFFECT_SECONDS:g} s after SIGCONT"
        )
    saw = f"{t.seen} after {t.elapsed:.1f} s" + (", wrong answer" if t.correct is False else "")
    return FaultResult(
        name,
        saw,
        await ctx.next_correct(conv),
        await ctx.recovered(),
        expected=t.status == 200 and t.correct is not False,
    )


FAULTS: dict[str, Callable[[Ctx], Awaitable[FaultResult]]] = {
    "p-restart": p_restarted,
    "d-restart": d_restarted,
    "d-stall": d_stalled,
    "d-full": d_filled,
    "burst-no-id": burst_without_ids,
    "client-gone": client_gone,
    "slow-clients": slow_clients,
    "worker-killed": worker_killed,
    "redis-paused": redis_paused,
}


async def _run(dep: Deployment, names: list[str], wave: WavePlan | None) -> list[FaultResult]:
    out = []
    async with Clients() as clients:
        ctx = Ctx(dep, clients, wave)
        for name in names:
            t0 = time.perf_counter()
            try:
                res = await FAULTS[name](ctx)
            except (RuntimeError, ClientError) as exc:
                res = FaultResult(name, f"campaign step failed: {exc}"[:120], False, False)
            res.seconds = time.perf_counter() - t0
            out.append(res)
    return out


def run_faults(
    dep: Deployment, names: list[str] | None = None, wave: WavePlan | None = None
) -> list[FaultResult]:
    """Each fault in turn; ``wave`` sizes the d-full case (default: :class:`WavePlan`)."""
    return asyncio.run(_run(dep, list(names or FAULTS), wave))
