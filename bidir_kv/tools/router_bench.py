"""Router benchmark: added latency and throughput of ``bidir-kv proxy``.

``python -m bidir_kv.tools.router_bench`` starts two stub engines (P and D,
:mod:`bidir_kv.testing.doubles.stub_engine`, separate processes), our router, and a
minimal FastAPI + httpx relay of the same flow (the upstream example proxy's
stack), then drives multi-turn streaming conversations at each concurrency
against: the engines directly (the client does the P and D legs itself), the
relay, and our router (guard on, and with ``--no-continuation-guard``). All
in one run; it prints p50/p99 latency, added latency against direct, request
throughput and the ratios. Numbers depend on the machine: compare within a run.

``--prefill-entries N`` writes N retained turns into the Redis store of the
``*-redis-*`` modes before measuring (half keyed by id, half by history with their
prefix index), so those modes run against a full store; ``--baseline DIR`` runs the
``baseline-*`` modes with the router of another source tree (e.g. ``git archive REV``
unpacked into DIR) in the same run, for an A/B of the router's CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bidir_kv.client import CHAT_PATH, AsyncNodeClient, ClientError, Reply, read_reply, scrape
from bidir_kv.launch.process import ManagedProcess, cpu_seconds, free_port, wait_http_ok
from bidir_kv.protocol import KVTransferParams
from bidir_kv.testing.doubles.relay import HOST, serve_relay

__all__ = ["main", "run_cell"]
TURNS_PER_CONVERSATION = 5


# ---- load generation ----------------------------------------------------------------


@dataclass
class Cell:
    mode: str
    concurrency: int
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    elapsed: float = 0.0
    internal_p50: float | None = None  # router's own time before the first byte (histogram)
    internal_p99: float | None = None
    completed: int = 0  # requests answered, warm-up included (what the CPU time paid for)
    cpu_s: float | None = None  # the proxy's own CPU seconds over those requests
    hits: float | None = None  # the router's cache_hits_total over the cell (warm-up included)

    @property
    def cpu_ms_per_request(self) -> float | None:
        if self.cpu_s is None or not self.completed:
            return None
        return self.cpu_s * 1000 / self.completed

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


class Conversation:
    def __init__(self, worker: int, send_id: bool = True, rewrite: bool = False) -> None:
        self.worker = worker
        self.send_id = send_id  # False: the router recognises the turn by its history
        # True: the client sends a recorded answer back instead of the one it got, so
        # every later turn is found by a shorter history and cut by the guard
        self.rewrite = rewrite
        self._new()

    def _new(self) -> None:
        self.id = f"bench-{self.worker}-{uuid.uuid4().hex[:8]}"
        self.turn = 0
        self.messages: list[dict[str, str]] = [
            # the id in the text too: no two conversations share a history
            {"role": "user", "content": f"{self.id}: " + "tell me about the sea. " * 8}
        ]

    def body(self) -> dict[str, Any]:
        body = {"model": "tiny", "messages": self.messages, "max_tokens": 8, "stream": True}
        if self.send_id:
            body["conversation_id"] = self.id
        return body

    def answered(self, text: str) -> None:
        self.turn += 1
        if self.turn >= TURNS_PER_CONVERSATION:
            self._new()
            return
        self.messages = [
            *self.messages,
            {"role": "assistant", "content": "a recorded answer" if self.rewrite else text},
            {"role": "user", "content": f"more, part {self.turn}"},
        ]


def _text(reply: Reply) -> str:
    """The streamed answer's text; a stream that did not end with ``[DONE]`` fails."""
    if reply.status != 200 or not reply.content.rstrip().endswith(b"data: [DONE]"):
        raise RuntimeError(f"HTTP {reply.status}: {reply.content[-200:]!r}")
    return read_reply(reply, stream=True).text


async def _via_proxy(clients: dict[str, AsyncNodeClient], url: str, conv: Conversation) -> str:
    return _text(await clients[url].post(CHAT_PATH, conv.body()))


async def _direct(
    clients: dict[str, AsyncNodeClient], p_url: str, d_url: str, conv: Conversation
) -> str:
    body = conv.body()
    body.pop("conversation_id", None)
    p_body = dict(
        body, stream=False, max_tokens=1, kv_transfer_params=KVTransferParams.miss().to_dict()
    )
    reply = (await clients[p_url].post(CHAT_PATH, p_body)).raise_for_status()
    params = reply.json_object()["kv_transfer_params"]
    params["remote_host"] = HOST
    return _text(await clients[d_url].post(CHAT_PATH, dict(body, kv_transfer_params=params)))


async def run_cell(
    mode: str,
    target: Any,
    concurrency: int,
    duration: float,
    warmup: float,
    cell: Cell | None = None,
) -> Cell:
    """Drive ``concurrency`` closed-loop clients for ``duration`` s (adds to ``cell``)."""
    cell = cell or Cell(mode, concurrency)
    urls = list(target) if mode == "direct" else [target]
    session = {url: AsyncNodeClient(url) for url in urls}
    try:
        stop_at = [0.0]
        measuring = [False]

        async def worker(i: int) -> None:
            conv = Conversation(i, send_id=mode not in NO_ID_MODES, rewrite=mode in REWRITE_MODES)
            while time.perf_counter() < stop_at[0]:
                t = time.perf_counter()
                try:
                    if mode == "direct":
                        text = await _direct(session, target[0], target[1], conv)
                    else:
                        text = await _via_proxy(session, target, conv)
                except (ClientError, RuntimeError, KeyError, TypeError):
                    if measuring[0]:
                        cell.errors += 1
                    continue
                cell.completed += 1
                if measuring[0]:
                    cell.latencies.append(time.perf_counter() - t)
                conv.answered(text)

        stop_at[0] = time.perf_counter() + warmup
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        measuring[0] = True
        start = time.perf_counter()
        stop_at[0] = start + duration
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        cell.elapsed += time.perf_counter() - start
    finally:
        for client in session.values():
            await client.aclose()
    return cell


# ---- orchestration ----------------------------------------------------------------


async def prefill_store(url: str, count: int, tokens: int = 256) -> None:
    """Write ``count`` retained turns into the Redis store at ``url`` as routers leave
    them: half keyed by id, half by history digest with a prefix index as a 5-turn
    conversation's (its boundaries, :func:`bidir_kv.router.prefix.boundaries`)."""
    from array import array

    from bidir_kv.router.prefix import boundaries
    from bidir_kv.router.store import Entry, RedisStore

    store = RedisStore(url, ttl=3600, max_entries=2 * count + 100_000)
    try:
        now = time.time()
        ids = array("I", range(tokens))
        params = KVTransferParams.build(
            do_remote_decode=True,
            remote_block_ids=[list(range(1, tokens // 16 + 1))],
            remote_engine_id="prefilled",
            remote_request_id="prefilled",
            remote_host=HOST,
            remote_port=1,
            remote_num_tokens=tokens,
        )
        entry = Entry(params=params, decode="prefilled:1", prefill=None, created=now, tokens=ids)

        async def put(i: int) -> None:
            if i % 2:
                await store.put(f"anon/prefilled-{i}", entry)
                return
            keys = [f"anon#{uuid.uuid4().hex}{i:08x}" for _ in boundaries(1, 10)]
            await store.put(keys[0], entry, index=keys)

        for start in range(0, count, 512):
            await asyncio.gather(*(put(i) for i in range(start, min(count, start + 512))))
    finally:
        await store.close()


def _start(
    name: str, argv: list[str], log_dir: Path, port: int, env: dict[str, str] | None = None
) -> ManagedProcess:
    proc = ManagedProcess(name, argv, log_dir / f"{name}.log", env=env).start()
    try:
        wait_http_ok(
            f"http://{HOST}:{port}/health" if name != "relay" else f"http://{HOST}:{port}/docs",
            30,
            alive=proc,
        )
    except BaseException:
        proc.stop()
        raise
    return proc


_HIST = "bidir_kv_router_added_latency_seconds_bucket"


def _buckets(url: str) -> dict[float, float]:
    snap = scrape(url)
    out: dict[float, float] = {}
    for le in (
        "0.0001",
        "0.00025",
        "0.0005",
        "0.001",
        "0.002",
        "0.005",
        "0.01",
        "0.025",
        "0.05",
        "0.1",
        "0.25",
        "1.0",
        "+Inf",
    ):
        out[float(le)] = snap.value(_HIST, le=le)
    return out


def _hits(url: str) -> float:
    return scrape(url).value("bidir_kv_router_cache_hits_total")


def _quantile_bound(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Upper bucket bound below which a fraction ``q`` of the observations fell."""
    total = after[float("inf")] - before[float("inf")]
    for le in sorted(after):
        if total and after[le] - before[le] >= q * total:
            return le
    return float("nan")


def _fmt(x: float) -> str:
    return f"{x * 1000:8.2f}"


DEFAULT_MODES = ("direct", "relay", "router", "router-noguard")
# modes served by our router, and the extra flags each is started with; router-id and
# router-history compare the two identities (docs/router.md "Identity"): ids sent and
# --identity id, against no id and the default --identity both (the history digest);
# *-prefix: no id, and a recorded answer sent back instead of the real one (found by a
# shorter history, cut by the guard); *-redis-*: on the Redis store (--prefill-entries
# fills it); baseline-*: the router of --baseline DIR
ROUTER_MODES = {
    "router": (),
    "router-noguard": ("--no-continuation-guard",),
    "router-id": ("--identity", "id"),
    "router-history": ("--identity", "both"),
    "router-prefix": ("--identity", "both"),
    "router-redis-id": ("--identity", "id"),
    "router-redis-history": ("--identity", "both"),
    "router-redis-prefix": ("--identity", "both"),
}
BASELINE_MODES = {
    "baseline-id": ("--identity", "id"),
    "baseline-redis-id": ("--identity", "id"),
}
REDIS_MODES = frozenset(
    {"router-redis", "router-workers", "router-redis-id", "router-redis-history"}
    | {"router-redis-prefix", "baseline-redis-id"}
)
MODES = (
    "direct",
    "relay",
    "router",
    "router-noguard",
    "router-redis",
    "router-workers",
    *(m for m in ROUTER_MODES if m not in ("router", "router-noguard")),
    *BASELINE_MODES,
)
NO_ID_MODES = frozenset(  # clients send no conversation id
    {"router-history", "router-prefix", "router-redis-history", "router-redis-prefix"}
)
REWRITE_MODES = frozenset({"router-prefix", "router-redis-prefix"})


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bidir_kv.tools.router_bench", description=__doc__)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds measured per cell")
    ap.add_argument("--warmup", type=float, default=0.5, help="seconds before measuring, per round")
    ap.add_argument(
        "--rounds", type=int, default=3, help="modes alternate in this many rounds per concurrency"
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        default=list(DEFAULT_MODES),
        choices=MODES,
        help="router-redis: one router on a Redis store; router-workers: "
        "--workers routers on one port sharing that store; router-id: ids sent, "
        "--identity id; router-history: no ids, --identity both",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=2,
        help="router processes of the router-workers mode (default 2)",
    )
    ap.add_argument(
        "--prefill-entries",
        type=int,
        default=0,
        help="retained turns written into the Redis store before measuring (the "
        "*-redis-* modes; half by id, half by history with their index)",
    )
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a bidir-kv source tree whose router runs the baseline-* modes",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    return ap


def _use_uvloop() -> str:
    """The client's event loop: uvloop when installed (as the router uses), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


def _start_all(
    modes: Sequence[str],
    log_dir: Path,
    procs: list[ManagedProcess],
    pids: dict[str, int | None],
    workers: int = 2,
    prefill: int = 0,
    baseline: Path | None = None,
) -> dict[str, Any]:
    """Start the stub engines and every proxy in ``modes``; each mode's target URL(s).

    Started processes are appended to ``procs`` as they come up, so the caller stops
    them even when a later one fails to start.
    """
    py = sys.executable
    p_port, d_port = free_port(), free_port()
    procs.append(
        _start(
            "stub-p",
            [
                py,
                "-m",
                "bidir_kv.testing.doubles.stub_engine",
                "--port",
                str(p_port),
                "--name",
                "p",
            ],
            log_dir,
            p_port,
        )
    )
    procs.append(
        _start(
            "stub-d",
            [
                py,
                "-m",
                "bidir_kv.testing.doubles.stub_engine",
                "--port",
                str(d_port),
                "--name",
                "d",
                "--side-port",
                "5700",
            ],
            log_dir,
            d_port,
        )
    )
    targets: dict[str, Any] = {"direct": (f"http://{HOST}:{p_port}", f"http://{HOST}:{d_port}")}
    upstream = [
        "--prefiller-hosts",
        HOST,
        "--prefiller-ports",
        str(p_port),
        "--decoder-hosts",
        HOST,
        "--decoder-ports",
        str(d_port),
    ]
    modes_flags = {m: list(f) for m, f in {**ROUTER_MODES, **BASELINE_MODES}.items()}
    if REDIS_MODES & set(modes):
        from bidir_kv.topology.redis_server import RedisServer

        redis = RedisServer(log_dir).start()
        assert redis.process is not None
        procs.append(redis.process)  # stopped with the others
        for mode in REDIS_MODES:
            modes_flags.setdefault(mode, [])
            modes_flags[mode] += ["--store", redis.url]
        modes_flags["router-workers"] += ["--workers", str(workers)]
        if prefill:
            asyncio.run(prefill_store(redis.url, prefill))
    for mode, extra in modes_flags.items():
        if mode not in modes:
            continue
        if prefill:  # room for the filled turns and the run's: no eviction while measuring
            extra = [*extra, "--max-conversations", str(2 * prefill + 100_000)]
        env = None
        if mode in BASELINE_MODES:
            if baseline is None:
                raise SystemExit(f"mode {mode} needs --baseline DIR (a bidir-kv source tree)")
            env = {**os.environ, "PYTHONPATH": str(baseline.resolve())}
        port = free_port()
        procs.append(
            _start(
                mode,
                [
                    py,
                    "-m",
                    "bidir_kv",
                    "proxy",
                    "--host",
                    HOST,
                    "--port",
                    str(port),
                    *upstream,
                    "--log-level",
                    "warning",
                    *extra,
                ],
                log_dir,
                port,
                env=env,
            )
        )
        targets[mode] = f"http://{HOST}:{port}"
        pids[mode] = procs[-1].pid
    if "relay" in modes:
        port = free_port()
        procs.append(
            _start(
                "relay",
                [
                    py,
                    "-m",
                    "bidir_kv.tools.router_bench",
                    "relay",
                    "--port",
                    str(port),
                    "--prefill",
                    f"{HOST}:{p_port}",
                    "--decode",
                    f"{HOST}:{d_port}",
                ],
                log_dir,
                port,
            )
        )
        targets["relay"] = f"http://{HOST}:{port}"
        pids["relay"] = procs[-1].pid
    return targets


def _measure(
    args: argparse.Namespace, targets: dict[str, Any], pids: dict[str, int | None], c: int
) -> dict[str, Cell]:
    """Every mode at concurrency ``c``, in interleaved rounds, with the router's own time
    and the proxy process's CPU time (its kernel accounting, workers included)."""
    cells = {mode: Cell(mode, c) for mode in args.modes}
    # router-workers' /metrics answers for one worker only: no histogram for it
    hist0 = {
        m: _buckets(targets[m])
        for m in args.modes
        if m in ROUTER_MODES or m in BASELINE_MODES or m == "router-redis"
    }
    hits0 = {m: _hits(targets[m]) for m in hist0}
    # Modes take turns in short rounds, so drifting machine load hits all alike.
    for _ in range(args.rounds):
        for mode in args.modes:
            pid = pids.get(mode)
            cpu0 = cpu_seconds(pid) if pid else None
            asyncio.run(
                run_cell(
                    mode, targets[mode], c, args.duration / args.rounds, args.warmup, cells[mode]
                )
            )
            cpu1 = cpu_seconds(pid) if pid else None
            if cpu0 is not None and cpu1 is not None:
                cells[mode].cpu_s = (cells[mode].cpu_s or 0.0) + cpu1 - cpu0
    for mode, before in hist0.items():
        cells[mode].hits = _hits(targets[mode]) - hits0[mode]
        after = _buckets(targets[mode])
        cells[mode].internal_p50 = _quantile_bound(before, after, 0.5)
        cells[mode].internal_p99 = _quantile_bound(before, after, 0.99)
    return cells


def _print_cells(c: int, cells: dict[str, Cell]) -> None:
    base = cells.get("direct")
    print(f"\nconcurrency {c}")
    print(
        f"  {'mode':<15} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'+p50 ms':>8} {'+p99 ms':>8} {'cpu ms/req':>10} errors"
    )
    for mode, cell in cells.items():
        add50 = cell.pct(0.5) - base.pct(0.5) if base else float("nan")
        add99 = cell.pct(0.99) - base.pct(0.99) if base else float("nan")
        cpu = cell.cpu_ms_per_request
        print(
            f"  {mode:<15} {cell.rps:8.1f} {_fmt(cell.pct(0.5))} "
            f"{_fmt(cell.pct(0.99))} {_fmt(add50)} {_fmt(add99)} "
            f"{'-' if cpu is None else f'{cpu:.3f}':>10} {cell.errors}"
        )
    for mode, cell in cells.items():
        if cell.internal_p50 is not None:
            print(
                f"  {mode}: own time before first byte (outside engine waits, warmup "
                f"included) p50 <= {cell.internal_p50 * 1000:g} ms, "
                f"p99 <= {(cell.internal_p99 or 0) * 1000:g} ms; cache hits "
                f"{cell.hits or 0:.0f} of {cell.completed} requests"
            )
    _print_ratios(cells)


def _print_ratios(cells: dict[str, Cell]) -> None:
    relay, base = cells.get("relay"), cells.get("direct")
    relay_cpu = relay.cpu_ms_per_request if relay else None
    for mode in (m for m in MODES if m not in ("direct", "relay")):
        cell = cells.get(mode)
        if cell is None:
            continue
        if relay and relay.rps:
            print(f"  {mode} / relay throughput: {cell.rps / relay.rps:.2f}x")
        cpu = cell.cpu_ms_per_request
        if relay_cpu and cpu is not None:
            print(f"  {mode} / relay CPU per request: {cpu / relay_cpu:.2f}x")
        if base and base.rps:
            print(f"  {mode} / direct throughput: {cell.rps / base.rps:.2f}x")
    caps = [
        f"{m} {1000 / c.cpu_ms_per_request:.0f}" for m, c in cells.items() if c.cpu_ms_per_request
    ]
    if caps:  # what one fully given core would serve at this CPU cost per request
        print(f"  CPU-bound capacity, req/s per core: {', '.join(caps)}")
    for a, b in _CPU_PAIRS:
        ca, cb = cells.get(a), cells.get(b)
        if ca and cb and ca.cpu_ms_per_request and cb.cpu_ms_per_request:
            print(
                f"  {a} / {b} CPU per request: {ca.cpu_ms_per_request / cb.cpu_ms_per_request:.3f}x"
            )
    single, multi = cells.get("router-redis"), cells.get("router-workers")
    if single and multi and single.rps:
        print(
            f"  router-workers / router-redis throughput (same store): "
            f"{multi.rps / single.rps:.2f}x"
        )


# CPU per request compared pairwise when both modes ran: the history and prefix paths
# against the id path, and this tree's against the baseline's
_CPU_PAIRS = (
    ("router-history", "router-id"),
    ("router-prefix", "router-id"),
    ("router-id", "baseline-id"),
    ("router-history", "baseline-id"),
    ("router-prefix", "baseline-id"),
    ("router-redis-history", "router-redis-id"),
    ("router-redis-prefix", "router-redis-id"),
    ("router-redis-id", "baseline-redis-id"),
    ("router-redis-history", "baseline-redis-id"),
    ("router-redis-prefix", "baseline-redis-id"),
)


def _write_json(path: Path, results: Sequence[Cell]) -> None:
    path.write_text(
        json.dumps(
            [
                {
                    "mode": r.mode,
                    "concurrency": r.concurrency,
                    "rps": r.rps,
                    "p50_s": r.pct(0.5),
                    "p99_s": r.pct(0.99),
                    "n": len(r.latencies),
                    "errors": r.errors,
                    "cpu_ms_per_request": r.cpu_ms_per_request,
                    "router_own_p50_s_bound": r.internal_p50,
                    "router_own_p99_s_bound": r.internal_p99,
                }
                for r in results
            ],
            indent=2,
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["relay"]:
        return serve_relay(args_list[1:])
    args = _parser().parse_args(args_list)
    loop_name = _use_uvloop()
    procs: list[ManagedProcess] = []
    log_dir = Path(tempfile.mkdtemp(prefix="bidir-kv-router-bench-"))
    try:
        pids: dict[str, int | None] = {}
        targets = _start_all(
            args.modes, log_dir, procs, pids, args.workers, args.prefill_entries, args.baseline
        )
        print(
            "router benchmark: upstream = stub engines (bidir_kv.testing.doubles.stub_engine, "
            f"aiohttp, 8-token streamed answers), {TURNS_PER_CONVERSATION}-turn conversations, "
            f"client loop {loop_name}, {args.duration:g}s per cell in {args.rounds} "
            f"interleaved rounds; {args.prefill_entries} turns filled into the Redis "
            f"store; logs in {log_dir}"
        )
        results: list[Cell] = []
        for c in args.concurrency:
            cells = _measure(args, targets, pids, c)
            results.extend(cells.values())
            _print_cells(c, cells)
        if args.json:
            _write_json(args.json, results)
    finally:
        for proc in reversed(procs):
            proc.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
