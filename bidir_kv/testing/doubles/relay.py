"""The comparison relay of the router benchmark: the upstream example proxy's flow on its stack.

FastAPI + httpx + uvicorn, as the upstream proxy runs, reduced to the flow itself: a
dict cache of D's params per conversation, the P leg, the streamed D leg. The router
benchmark runs it next to our router so both are measured against the same engines.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from bidir_kv.policy import entry_is_stale
from bidir_kv.protocol import KVTransferParams
from bidir_kv.router.settings import UPSTREAM_CACHE_TTL

__all__ = ["HOST", "relay_app", "serve_relay"]

HOST = "127.0.0.1"


def relay_app(prefill_url: str, decode_url: str, prefill_host: str, decode_host: str) -> Any:
    """The upstream proxy's flow on its stack, minimal: dict cache, P leg, streamed D leg."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    cache: dict[str, tuple[dict[str, Any], float]] = {}
    # As upstream: no timeout, httpx's default pool limits.
    client = httpx.AsyncClient(timeout=None)
    miss = KVTransferParams.miss().to_dict()

    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        conv = body.pop("conversation_id", None)
        cached = cache.pop(conv, None) if conv else None
        if cached is not None and not entry_is_stale(cached[1], time.time(), UPSTREAM_CACHE_TTL):
            params = dict(cached[0], do_remote_decode=True, do_remote_prefill=False)
        else:
            params = dict(miss)
        p_body = dict(body, stream=False, max_tokens=1, kv_transfer_params=params)
        for k in ("max_completion_tokens", "min_tokens", "stream_options"):
            p_body.pop(k, None)
        headers = {"X-Request-Id": str(uuid.uuid4())}
        r = await client.post(f"{prefill_url}/v1/chat/completions", json=p_body, headers=headers)
        r.raise_for_status()
        p_params = r.json().get("kv_transfer_params")
        d_body = dict(body, stream=True)
        if p_params:
            d_body["kv_transfer_params"] = dict(p_params, remote_host=prefill_host)
        else:
            d_body["kv_transfer_params"] = dict(miss)

        async def gen() -> Any:
            async with client.stream(
                "POST", f"{decode_url}/v1/chat/completions", json=d_body, headers=headers
            ) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        kv = chunk.get("kv_transfer_params")
                        if kv and conv:
                            cache[conv] = (dict(kv, remote_host=decode_host), time.time())
                    if line:
                        yield line + "\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    # Postponed annotations are strings here; FastAPI needs the real types to inject.
    chat.__annotations__ = {"request": Request, "return": StreamingResponse}
    app.post("/v1/chat/completions")(chat)
    return app


def serve_relay(argv: Sequence[str]) -> int:
    """``router_bench relay --port N --prefill H:P --decode H:P``: serve the relay (blocks)."""
    ap = argparse.ArgumentParser(prog="python -m bidir_kv.tools.router_bench relay")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True, help="host:port")
    ap.add_argument("--decode", required=True, help="host:port")
    args = ap.parse_args(argv)
    import uvicorn

    p_host, d_host = args.prefill.split(":")[0], args.decode.split(":")[0]
    app = relay_app(f"http://{args.prefill}", f"http://{args.decode}", p_host, d_host)
    # httptools, uvicorn's fast parser (what "auto" picks when installed; the upstream
    # proxy's environment has it): a baseline on the slower h11 would flatter our router
    uvicorn.run(
        app,
        host=HOST,
        port=args.port,
        log_level="warning",
        access_log=False,
        loop="auto",
        http="httptools",
    )
    return 0
