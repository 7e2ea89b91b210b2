"""Is the bench client ever the bottleneck? Measure what it sustains against a trivial server.

A trivial SSE chat server runs in a child process (so it does not share the
client's event loop) and answers every request at once with ``chunks`` content
chunks. The client then drives it with the same ``stream_chat`` the sweep uses,
``clients`` at a time, and reports requests/s and chunks/s. Comparing those with
the highest rates a sweep needed gives the margin (the acceptance asks ≥ 10×).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bidir_kv.bench.client import build_chat_body, stream_chat
from bidir_kv.client import AsyncNodeClient
from bidir_kv.launch.process import ManagedProcess, free_port, wait_http_ok

__all__ = ["Capacity", "client_capacity", "measure_capacity", "serve_trivial"]


@dataclass
class Capacity:
    requests: int
    seconds: float
    requests_per_s: float
    chunks_per_s: float
    chunks_per_request: int
    clients: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def serve_trivial(port: int, chunks: int) -> None:
    """Run the trivial SSE server until killed (child-process entry point)."""
    from aiohttp import web

    head = b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x'
    tail = b'"},"finish_reason":null}]}\n\n'
    body = b"".join(head + str(i).encode() + tail for i in range(chunks))
    body += (
        b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{},'
        b'"finish_reason":"length"}],"kv_transfer_params":null}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":'
        + str(chunks).encode()
        + b"}}\n\ndata: [DONE]\n\n"
    )

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(body)
        await resp.write_eof()
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def _drive(url: str, clients: int, requests: int, chunks: int) -> Capacity:
    body = build_chat_body("tiny", [{"role": "user", "content": "hello"}], chunks, "cap-0")
    done = 0
    got_chunks = 0
    async with AsyncNodeClient(url) as session:

        async def worker() -> None:
            nonlocal done, got_chunks
            while done < requests:
                done += 1
                res = await stream_chat(session, body, headers={"X-Session-ID": "cap-0"})
                got_chunks += res.content_chunks

        await stream_chat(session, body)  # opens the first connection
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        dt = time.perf_counter() - t0
    return Capacity(
        requests=done,
        seconds=dt,
        requests_per_s=done / dt,
        chunks_per_s=got_chunks / dt,
        chunks_per_request=chunks,
        clients=clients,
    )


def measure_capacity(
    clients: int = 2, requests: int = 400, chunks: int = 32, log_dir: Path = Path("out")
) -> Capacity:
    """Start the trivial server, measure, stop it."""
    port = free_port()
    code = f"from bidir_kv.bench.capacity import serve_trivial; serve_trivial({port}, {chunks})"
    proc = ManagedProcess(
        "trivial-sse", [sys.executable, "-c", code], log_dir / "trivial-sse.log"
    ).start()
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 20.0, alive=proc)
        return asyncio.run(_drive(f"http://127.0.0.1:{port}", clients, requests, chunks))
    finally:
        proc.stop()


def client_capacity(manifest: Mapping[str, Any], clients: int, out: Path) -> dict[str, Any]:
    """Measured capacity next to the highest rates the manifest's runs needed, and the margin."""
    cap = measure_capacity(clients=max(2, clients), log_dir=out / "logs")
    need_rps = 0.0
    need_cps = 0.0
    for runs in manifest.get("runs", {}).values():
        for run in runs.values():
            if run["duration_s"] > 0:
                need_rps = max(need_rps, run["requests"] / run["duration_s"])
                need_cps = max(need_cps, run["chunks"] / run["duration_s"])
    margin = min(
        cap.requests_per_s / need_rps if need_rps else float("inf"),
        cap.chunks_per_s / need_cps if need_cps else float("inf"),
    )
    return {
        **cap.to_dict(),
        "needed_requests_per_s": need_rps,
        "needed_chunks_per_s": need_cps,
        "margin": margin,
    }


if __name__ == "__main__":
    print(json.dumps(measure_capacity().to_dict(), indent=1))
