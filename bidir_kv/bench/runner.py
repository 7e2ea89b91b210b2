"""Drive conversations against a router and record one stats file per sweep point.

Clients behave like vLLM's multi-turn benchmark: ``num_clients`` workers share
at most ``max_active_conversations`` open conversations; a conversation's next
turn becomes ready ``think_time`` after its previous answer, and the real answer
is appended to the history so every prompt is an exact continuation. The
metrics of every node are scraped before and after each point; the deltas go
next to the records (KV transfer time/bytes on P, prefill duration on the router).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bidir_kv.bench.client import build_chat_body, stream_chat
from bidir_kv.bench.memory import DEFAULT_INTERVAL_S, MemorySampler
from bidir_kv.bench.reuse import SentTurn
from bidir_kv.bench.stats import RequestRecord, write_records
from bidir_kv.bench.workload import Conversation, reply_in_history
from bidir_kv.client import AsyncNodeClient, ClientError, Completion, NodeClient, scrape
from bidir_kv.scrape import MetricsSnapshot

__all__ = [
    "ConversationState",
    "HttpTokenCounter",
    "PointResult",
    "RunOptions",
    "metrics_delta",
    "point_name",
    "run_point",
    "snapshot_nodes",
]


@dataclass(frozen=True)
class RunOptions:
    url: str
    model: str = "tiny"
    num_clients: int = 2
    max_active_conversations: int = 10
    send_conversation_id: bool = True
    request_timeout_s: float = 300.0
    ignore_eos: bool = True
    headers: Mapping[str, str] = field(default_factory=dict)
    # nodes whose KV memory is sampled while a point runs (bench/memory.py): D
    memory_urls: Mapping[str, str] = field(default_factory=dict)
    memory_interval_s: float = DEFAULT_INTERVAL_S
    # ask for the reply's token ids (return_token_ids), so the tokens D retains are
    # known and bench can say how much of each prompt was reusable (bench/reuse.py)
    token_ids: bool = True


@dataclass
class PointResult:
    records: list[RequestRecord]
    duration_s: float
    interrupted: bool = False
    memory: dict[str, Any] = field(default_factory=dict)  # MemorySampler.to_dict()

    @property
    def errors(self) -> int:
        return sum(1 for r in self.records if not r.ok)


def point_name(prefix_tokens: int) -> str:
    return f"p{prefix_tokens:06d}"


class HttpTokenCounter:
    """Counts content tokens with a server's ``/tokenize`` (cached; synchronous)."""

    def __init__(self, url: str, model: str, timeout: float = 30.0) -> None:
        self.client = NodeClient(url, timeout=timeout)
        self.url = self.client.url + "/tokenize"
        self.model = model
        self.timeout = timeout
        self.calls = 0

    def __call__(self, text: str) -> int:
        self.calls += 1
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        obj = self.client.post("/tokenize", body).raise_for_status().json_object()
        if isinstance(obj.get("count"), int):
            return int(obj["count"])
        tokens = obj.get("tokens")
        if not isinstance(tokens, list):
            raise RuntimeError(f"{self.url} returned neither 'count' nor 'tokens'")
        return len(tokens)

    def available(self) -> bool:
        try:
            self("probe")
        except (ClientError, RuntimeError):
            return False
        return True


@dataclass(order=True)
class _Ready:
    ready_at: float
    seq: int
    state: ConversationState = field(compare=False)


@dataclass
class ConversationState:
    """Where one conversation stands: its next turn and its history so far."""

    conv: Conversation
    next_turn: int = 0
    messages: list[dict[str, str]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    sent: list[SentTurn] = field(default_factory=list)  # what each request sent and got


async def run_point(
    conversations: Sequence[Conversation],
    opts: RunOptions,
    *,
    leg: str,
    on_request: Callable[[RequestRecord], None] | None = None,
    stop: asyncio.Event | None = None,
    upto_turn: int | None = None,
    states: dict[str, ConversationState] | None = None,
) -> PointResult:
    """Run every turn of ``conversations``; returns early (``interrupted``) when ``stop`` is set.

    ``upto_turn`` stops each conversation after that many turns in all; ``states``
    (keyed by conversation id) carries the histories between calls, so a later call
    continues each conversation where the earlier one left it (the real answers in it).
    """
    stop = stop or asyncio.Event()
    records: list[RequestRecord] = []
    states = {} if states is None else states
    limit = upto_turn

    def open_turns(conv: Conversation) -> bool:
        done = states[conv.conversation_id].next_turn if conv.conversation_id in states else 0
        return done < min(len(conv.turns), limit if limit is not None else len(conv.turns))

    pending = [c for c in reversed(conversations) if open_turns(c)]
    heap: list[_Ready] = []
    seq = itertools.count()
    cond = asyncio.Condition()
    in_flight = 0
    t0 = time.perf_counter()

    def activate() -> None:
        while pending and len(heap) + in_flight < opts.max_active_conversations:
            conv = pending.pop()
            state = states.setdefault(conv.conversation_id, ConversationState(conv))
            heapq.heappush(heap, _Ready(time.perf_counter(), next(seq), state))

    activate()
    async with AsyncNodeClient(opts.url, timeout=opts.request_timeout_s) as session:

        async def client(client_id: int) -> None:
            nonlocal in_flight
            while not stop.is_set():
                async with cond:
                    item: _Ready | None = None
                    while not stop.is_set():
                        now = time.perf_counter()
                        if heap and heap[0].ready_at <= now:
                            item = heapq.heappop(heap)
                            in_flight += 1
                            break
                        if not heap and in_flight == 0 and not pending:
                            return
                        wait = heap[0].ready_at - now if heap else None
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(cond.wait(), wait)
                    if item is None:
                        return
                state = item.state
                rec = await _one_turn(session, opts, state, client_id, leg, t0)
                records.append(rec)
                if on_request is not None:
                    on_request(rec)
                async with cond:
                    in_flight -= 1
                    state.next_turn += 1
                    if rec.ok and open_turns(state.conv):
                        gap = state.conv.turns[state.next_turn].think_time_s
                        heapq.heappush(heap, _Ready(time.perf_counter() + gap, next(seq), state))
                    activate()
                    cond.notify_all()

        async def watch_stop() -> None:
            await stop.wait()
            async with cond:
                cond.notify_all()

        watcher = asyncio.create_task(watch_stop())
        sampler = MemorySampler(opts.memory_urls, opts.memory_interval_s)
        sampling = asyncio.create_task(sampler.run())
        tasks = [asyncio.create_task(client(i)) for i in range(opts.num_clients)]
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            watcher.cancel()
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
    return PointResult(
        records,
        time.perf_counter() - t0,
        interrupted=stop.is_set(),
        memory=sampler.to_dict() if sampler.samples else {},
    )


async def _one_turn(
    session: AsyncNodeClient,
    opts: RunOptions,
    state: ConversationState,
    client_id: int,
    leg: str,
    t0: float,
) -> RequestRecord:
    turn = state.conv.turns[state.next_turn]
    state.messages.append({"role": "user", "content": turn.content})
    state.tokens.append(turn.content_tokens)
    cid = state.conv.conversation_id
    body = build_chat_body(
        opts.model,
        state.messages,
        turn.max_tokens,
        cid if opts.send_conversation_id else None,
        ignore_eos=opts.ignore_eos,
        token_ids=opts.token_ids,
    )
    sent_messages = len(state.messages)
    headers = dict(opts.headers)
    if opts.send_conversation_id:
        headers["X-Session-ID"] = cid
    start = time.perf_counter()
    error: str | None = None
    try:
        res = await stream_chat(session, body, headers=headers)
    except ClientError as exc:  # recorded as this request's failure, typed by name
        error = f"{type(exc).__name__}: {exc}"
        res = Completion(status=0, start=start, elapsed=time.perf_counter() - start)
    input_tokens = sum(state.tokens)
    history = input_tokens - turn.content_tokens
    out_tokens = res.output_tokens if error is None else 0
    latency_ms = res.elapsed * 1e3
    ttft_ms = (res.ttft or 0.0) * 1e3
    tpot_ms = (latency_ms - ttft_ms) / (out_tokens - 1) if out_tokens > 1 else 0.0
    rec = RequestRecord(
        ttft_ms=ttft_ms,
        tpot_ms=tpot_ms,
        latency_ms=latency_ms,
        start_time_ms=(res.start - t0) * 1e3,
        input_num_turns=len(state.messages),
        input_num_tokens=input_tokens,
        output_num_tokens=out_tokens,
        output_num_chunks=res.content_chunks,
        output_num_first_chunk_tokens=res.first_chunk_tokens,
        approx_cached_percent=100.0 * history / input_tokens if input_tokens else 0.0,
        conversation_id=cid,
        client_id=client_id,
        leg=leg,
        point=state.conv.prefix_tokens,
        turn=turn.index + 1,
        prompt_tokens=res.prompt_tokens,
        think_time_s=turn.think_time_s,
        beyond_ttl=turn.beyond_ttl,
        ok=error is None,
        error=error,
        itl_ms=[round(g * 1e3, 3) for g in res.itl] if error is None else [],
        cached_tokens=res.cached_tokens if error is None else None,
    )
    state.sent.append(SentTurn(rec, sent_messages, list(res.token_ids) if error is None else []))
    if error is None:
        reply = reply_in_history(res.text, state.conv.history, f"{cid}:{turn.index}")
        state.messages.append({"role": "assistant", "content": reply})
        # the reply's share of the history, in tokens (exact when it went back verbatim)
        state.tokens.append(round(out_tokens * len(reply) / len(res.text)) if res.text else 0)
    return rec


def snapshot_nodes(urls: Mapping[str, str]) -> dict[str, MetricsSnapshot | None]:
    """Scrape every node; a node without ``/metrics`` maps to ``None``."""
    out: dict[str, MetricsSnapshot | None] = {}
    for name, url in urls.items():
        try:
            out[name] = scrape(url)
        except ClientError:
            out[name] = None
    return out


def metrics_delta(
    before: Mapping[str, MetricsSnapshot | None], after: Mapping[str, MetricsSnapshot | None]
) -> dict[str, Any]:
    """Non-zero sample deltas per node, JSON-ready: ``{node: [[name, labels, delta], ...]}``."""
    out: dict[str, Any] = {}
    for name, snap_after in after.items():
        snap_before = before.get(name)
        if snap_after is None or snap_before is None:
            out[name] = None
            continue
        delta = snap_after - snap_before
        rows = []
        for (sample, labels), value in sorted(delta.samples.items()):
            if value != 0 and not sample.endswith("_created"):
                rows.append([sample, dict(labels), value])
        out[name] = rows
    return out


def write_point(
    out_dir: Path,
    leg: str,
    prefix_tokens: int,
    result: PointResult,
    metrics: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
) -> None:
    leg_dir = out_dir / leg
    leg_dir.mkdir(parents=True, exist_ok=True)
    name = point_name(prefix_tokens)
    write_records(leg_dir / f"{name}.stats.json", result.records)
    info = {
        "leg": leg,
        "prefix_tokens": prefix_tokens,
        "duration_s": result.duration_s,
        "requests": len(result.records),
        "errors": result.errors,
        "output_chunks": sum(r.output_num_chunks for r in result.records),
        "interrupted": result.interrupted,
        "metrics_delta": dict(metrics),
        "memory": result.memory,
        **(extra or {}),
    }
    tmp = leg_dir / f"{name}.metrics.json.tmp"
    tmp.write_text(json.dumps(info, indent=1))
    tmp.replace(leg_dir / f"{name}.metrics.json")
