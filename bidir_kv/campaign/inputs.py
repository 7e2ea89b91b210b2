"""The bad-input campaign: each hostile-input class sent to the router and to every engine.

Every input must get a 4xx (the router must not spend a P prefill on what D would
refuse); control characters in a conversation id are the one class answered 200,
escaped in the router's log instead. A 5xx anywhere fails the campaign.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bidir_kv.campaign.deploy import Deployment
from bidir_kv.client import ClientError, NodeClient, TransportError, scrape

__all__ = ["INPUTS", "BadInput", "InputResult", "run_inputs"]

PROMPT_TOKENS = "vllm:prompt_tokens_total"
CHAT = "/v1/chat/completions"
FORGED = "FORGED ERROR bidir_kv.router: everything is on fire"


def _good(**extra: object) -> dict[str, object]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4,
        **extra,
    }


@dataclass(frozen=True)
class BadInput:
    name: str
    data: bytes
    content_type: str = "application/json"
    path: str = CHAT
    expect: str = "4xx"  # 4xx | 2xx (router only; engines may answer either)


def _json(name: str, **extra: object) -> BadInput:
    return BadInput(name, json.dumps(_good(**extra)).encode())


_DEEP = 100_000
INPUTS: tuple[BadInput, ...] = (
    BadInput(
        "deep nesting (100k)",
        b'{"model": "tiny", "messages": ' + b"[" * _DEEP + b"]" * _DEEP + b"}",
    ),
    BadInput(
        "lone surrogate \\ud800",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
    ),
    BadInput(
        "invalid UTF-8 byte",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff"}]}',
    ),
    BadInput(
        "unknown charset", json.dumps(_good()).encode(), "application/json; charset=x-klingon"
    ),
    BadInput("not JSON", b'{"model": "tiny", "messages": ['),
    BadInput("JSON array body", b"[1, 2, 3]"),
    _json('"stream": "false"', stream="false"),
    _json('"stream": 0', stream=0),
    _json("max_tokens 0", max_tokens=0),
    _json("max_tokens -3", max_tokens=-3),
    _json('max_tokens "many"', max_tokens="many"),
    _json("max_completion_tokens 0", max_completion_tokens=0),
    _json("min_tokens > max_tokens", min_tokens=9),
    _json("n 2", n=2),
    _json('stream_options "usage"', stream=True, stream_options="usage"),
    BadInput("no messages", b'{"model": "tiny"}'),
    BadInput("no prompt", b'{"model": "tiny"}', path="/v1/completions"),
    _json("newline in conversation_id", conversation_id=f"c1\n{FORGED}\r\x1b[31m", max_tokens=2),
)
_ID_INPUT = INPUTS[-1].name


@dataclass
class InputResult:
    target: str  # router | prefill-0 | decode-0 ...
    name: str
    status: int | None  # None: no answer
    ok: bool
    note: str = ""


def _post(url: str, item: BadInput) -> int | None:
    """The answer's status; ``None`` when none came."""
    with NodeClient(url, timeout=60) as client:
        try:
            return client.request(
                "POST", item.path, content=item.data, headers={"Content-Type": item.content_type}
            ).status
        except TransportError:
            return None


def oversize(url: str, timeout: float = 10.0) -> tuple[int | None, float]:
    """Announce a 1 GB body, send one byte: (status, seconds to the answer)."""
    host, _, port = url.removeprefix("http://").rpartition(":")
    t0 = time.perf_counter()
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\n"
                b"Content-Length: 1000000000\r\n\r\n{"
            )
            reply = sock.recv(4096)
    except OSError:
        return None, time.perf_counter() - t0
    parts = reply.split(b" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    return status, time.perf_counter() - t0


def _prompt_tokens(url: str) -> float | None:
    try:
        return scrape(url).value(PROMPT_TOKENS)
    except ClientError:
        return None


OVERSIZE = "oversize body (1 GB announced)"


def _judge(target: str, item: BadInput, status: int | None) -> bool:
    if status is None or status >= 500:
        return False
    if item.name == _ID_INPUT:
        return status == 200 if target == "router" else status < 500
    return 400 <= status < 500


def _one_target(
    target: str, url: str, p_urls: list[str], log_check: Callable[[], bool] | None
) -> list[InputResult]:
    out = []
    for item in INPUTS:
        before = [_prompt_tokens(u) for u in p_urls] if target == "router" else []
        status = _post(url, item)
        ok, note = _judge(target, item, status), ""
        if before and item.expect == "4xx" and item.name != _ID_INPUT:
            after = [_prompt_tokens(u) for u in p_urls]
            pairs = zip(after, before, strict=True)
            if any(b is not None and a is not None and a != b for a, b in pairs):
                ok, note = False, "P prefilled it"
        if item.name == _ID_INPUT and target == "router" and log_check is not None:
            if not log_check():
                ok, note = False, "forged log line"
            else:
                note = "escaped in log"
        out.append(InputResult(target, item.name, status, ok, note))
    # an engine that reads on (vLLM) gets 2 s
    status, seconds = oversize(url, 10.0 if target == "router" else 2.0)
    if target == "router":
        out.append(InputResult(target, OVERSIZE, status, status == 413, f"{seconds * 1000:.0f} ms"))
    elif status is None:  # vLLM has no body limit and reads on: shown, not judged
        out.append(InputResult(target, OVERSIZE, status, True, "no early 413, not judged"))
    else:  # the emulated engine refuses by Content-Length (--max-body-bytes)
        out.append(InputResult(target, OVERSIZE, status, status == 413, f"{seconds * 1000:.0f} ms"))
    return out


def _log_check(path: str | None) -> Callable[[], bool] | None:
    if not path:
        return None

    def check() -> bool:
        text = Path(path).read_text(errors="replace")
        return not any(line.startswith(FORGED) for line in text.splitlines()) and "\x1b" not in text

    return check


def run_inputs(dep: Deployment) -> list[InputResult]:
    """Every input at the router, then at each engine directly."""
    log = None
    if dep.topology is not None and dep.topology.routers:
        log = dep.topology.routers[0].log_path
    results = _one_target("router", dep.router_url, dep.prefill_urls, _log_check(log))
    for role, urls in (("prefill", dep.prefill_urls), ("decode", dep.decode_urls)):
        for i, url in enumerate(urls):
            results.extend(_one_target(f"{role}-{i}", url, [], None))
    return results
