"""A small, dependency-free client for P/D engines, as the conformance scenarios drive them.

Scenarios talk to any backend (our emulator, real vLLM, an external deployment) the
same way a router does, but without one, so each leg can be observed:
``/v1/completions`` with a token-id prompt, ``temperature 0``, ``ignore_eos`` and
``return_token_ids`` (tokenization can never blur a comparison), plus ``/metrics``
snapshots around each leg. The flow is docs/vllm-cpu.md §7.4 / docs/protocol.md §1.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bidir_kv.protocol import (
    KVTransferParams,
    iter_sse_data,
    params_from_response,
    scan_terminal_chunk,
)
from bidir_kv.scrape import MetricsSnapshot, parse_metrics, scrape
from bidir_kv.topology.base import Node

__all__ = [
    "TOKENS_BY_SOURCE",
    "Completion",
    "EngineClient",
    "LegDelta",
    "PDTurn",
    "completion_from_bytes",
    "run_pd_turn",
    "tokens_by_source",
]

TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
NIXL_XFERS = "vllm:nixl_xfer_time_seconds_count"
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"
NIXL_EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
NOTIFS_AFTER_EXPIRY = "vllm:nixl_num_notifications_after_expiry_total"
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
# the counters scenarios assert on (scraped cheaply, see EngineClient.metrics)
WATCHED = (TOKENS_BY_SOURCE, NIXL_BYTES, NIXL_XFERS, NIXL_FAILED, NIXL_EXPIRED,
           NOTIFS_AFTER_EXPIRY, CACHED_BY_SOURCE)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass
class Completion:
    """One ``/v1/completions`` call as the scenarios need it."""

    status: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    params: KVTransferParams | None = None
    params_present: bool = False  # the response carried the key at all
    usage: dict[str, Any] | None = None
    error: str | None = None
    elapsed: float = 0.0
    chunks: int = 0  # SSE data chunks (streaming only)
    # streaming: where params appeared; index of the chunk, and whether it had finish_reason
    params_chunk: int | None = None
    params_on_terminal: bool | None = None
    nonterminal_params_values: list[Any] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and self.error is None

    def require_ok(self) -> Completion:
        if not self.ok:
            raise AssertionError(f"request failed: HTTP {self.status}: {self.error}")
        return self

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
        return None if value is None else int(value)


def tokens_by_source(delta: MetricsSnapshot) -> dict[str, int]:
    """``{source: tokens}`` from a metrics delta (vLLM's per-source prompt counter)."""
    return {s: int(delta.value(TOKENS_BY_SOURCE, source=s)) for s in SOURCES}


class EngineClient:
    """HTTP handle to one engine node (P, D or a plain reference server)."""

    def __init__(self, node: Node, model: str = "tiny", timeout: float = 120.0) -> None:
        self.node = node
        self.url = node.url
        self.model = model
        self.timeout = timeout
        self._unusable: str | None = None

    def __repr__(self) -> str:
        return f"EngineClient({self.node.name} {self.url})"

    @contextlib.contextmanager
    def unusable(self, why: str) -> Iterator[None]:
        """Within the block, any request through this client raises, naming ``why``
        (a paused server would just hang it)."""
        self._unusable = why
        try:
            yield
        finally:
            self._unusable = None

    def _check_usable(self) -> None:
        if self._unusable is not None:
            raise RuntimeError(f"{self.node.name} cannot be used here: {self._unusable}")

    # ---- requests -------------------------------------------------------------

    def body(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        params: KVTransferParams | None = None,
        *,
        stream: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        }
        if params is not None:
            body["kv_transfer_params"] = params.to_dict()
        body.update(extra or {})
        return body

    def complete(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        params: KVTransferParams | None = None,
        *,
        stream: bool = False,
        extra: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Completion:
        body = self.body(prompt, max_tokens, params, stream=stream, extra=extra)
        return self.post("/v1/completions", body, timeout=timeout)

    def post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> Completion:
        self._check_usable()
        data = json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                if body.get("stream"):
                    out = _read_stream(resp)
                else:
                    out = _read_body(json.loads(resp.read()))
                out.status = resp.status
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            out = Completion(status=exc.code, error=text[:2000])
        except (TimeoutError, urllib.error.URLError, ConnectionError) as exc:
            out = Completion(status=0, error=f"{type(exc).__name__}: {exc}")
        out.elapsed = time.perf_counter() - t0
        return out

    # ---- observation ------------------------------------------------------------

    def metrics(self, names: Sequence[str] | None = None) -> MetricsSnapshot:
        """Scrape ``/metrics``; with ``names`` only those samples are parsed (vLLM's
        exposition is ~100 KB of histograms, and parsing it all is slow on busy CI)."""
        self._check_usable()
        if names is None:
            return scrape(self.url, timeout=self.timeout)
        with urllib.request.urlopen(self.url + "/metrics", timeout=self.timeout) as resp:
            text = resp.read().decode()
        keep = tuple(names)
        lines = [ln for ln in text.splitlines() if ln.startswith(keep)]
        return MetricsSnapshot(parse_metrics("\n".join(lines) + "\n"))

    def log_mark(self) -> int:
        """Current size of the node's log (for :meth:`log_since`); 0 without a log."""
        path = self.node.log_path
        if not path:
            return 0
        try:
            return Path(path).stat().st_size
        except OSError:
            return 0

    def log_since(self, mark: int) -> str | None:
        """Log text written after ``mark``; ``None`` when the node's log is not ours."""
        path = self.node.log_path
        if not path:
            return None
        with open(path, "rb") as fh:
            fh.seek(mark)
            return fh.read().decode(errors="replace")

    @property
    def has_log(self) -> bool:
        return bool(self.node.log_path)


def _read_body(body: dict[str, Any]) -> Completion:
    choice = (body.get("choices") or [{}])[0]
    return Completion(
        status=200,
        token_ids=[int(t) for t in (choice.get("token_ids") or [])],
        text=str(choice.get("text") or ""),
        finish_reason=choice.get("finish_reason"),
        params=params_from_response(body),
        params_present="kv_transfer_params" in body,
        usage=body.get("usage"),
    )


def completion_from_bytes(status: int, raw: bytes, stream: bool) -> Completion:
    """A :class:`Completion` from a whole response body (for clients other than urllib)."""
    if status != 200:
        return Completion(status=status, error=raw.decode(errors="replace")[:2000])
    out = _read_stream(raw.split(b"\n")) if stream else _read_body(json.loads(raw))
    out.status = status
    return out


def _lines(resp: Any) -> Iterator[bytes]:
    yield from resp


def _read_stream(resp: Any) -> Completion:
    out = Completion(status=200)
    for i, data in enumerate(iter_sse_data(_lines(resp))):
        if data == b"[DONE]":
            break
        out.chunks += 1
        chunk = json.loads(data)
        for choice in chunk.get("choices") or ():
            out.token_ids.extend(int(t) for t in (choice.get("token_ids") or []))
            out.text += str(choice.get("text") or "")
            if choice.get("finish_reason") is not None:
                out.finish_reason = choice["finish_reason"]
        if chunk.get("usage"):
            out.usage = chunk["usage"]
        if "kv_transfer_params" in chunk:
            out.params_present = True
        terminal = scan_terminal_chunk(data)
        if terminal is not None and terminal.params is not None:
            out.params = terminal.params
            out.params_chunk = i
            out.params_on_terminal = bool(terminal.finish_reason)
        elif "kv_transfer_params" in chunk and terminal is None:
            out.nonterminal_params_values.append(chunk["kv_transfer_params"])
    return out


@dataclass
class LegDelta:
    """Metric deltas on P and D across one leg of a turn."""

    p: MetricsSnapshot
    d: MetricsSnapshot

    @property
    def p_sources(self) -> dict[str, int]:
        return tokens_by_source(self.p)


@dataclass
class PDTurn:
    """One turn driven directly through P then D (no router)."""

    prompt: list[int]
    sent_to_p: KVTransferParams
    p: Completion
    d: Completion | None
    p_leg: LegDelta
    d_leg: LegDelta | None

    @property
    def sequence(self) -> list[int]:
        """D's full token sequence after this turn: prompt + generated."""
        assert self.d is not None
        return [*self.prompt, *self.d.token_ids]


def settled_metrics(client: EngineClient, timeout: float = 5.0, interval: float = 0.05) -> \
        MetricsSnapshot:
    """Scrape until two consecutive snapshots agree (stats land a step after a response)."""
    deadline = time.monotonic() + timeout
    prev = client.metrics(WATCHED)
    while time.monotonic() < deadline:
        time.sleep(interval)
        cur = client.metrics(WATCHED)
        if cur.samples == prev.samples:
            return cur
        prev = cur
    return prev


def run_pd_turn(
    prefill: EngineClient,
    decode: EngineClient,
    prompt: Sequence[int],
    max_tokens: int,
    previous: KVTransferParams | None = None,
    *,
    stream_decode: bool = False,
    decode_host: str | None = None,
) -> PDTurn:
    """P leg (``max_tokens=1``, miss dict or D's previous dict) then D leg with P's dict.

    ``decode_host`` rewrites ``remote_host`` like a router does; ``None`` keeps it.
    If P fails or returns no params, the D leg is skipped (``d`` is ``None``).
    """
    sent = KVTransferParams.miss() if previous is None else previous.for_prefill_hit(decode_host)
    p0, d0 = settled_metrics(prefill), settled_metrics(decode)
    p_resp = prefill.complete(prompt, 1, sent)
    p1, d1 = settled_metrics(prefill), settled_metrics(decode)
    p_leg = LegDelta(p1 - p0, d1 - d0)
    if not p_resp.ok or p_resp.params is None:
        return PDTurn(list(prompt), sent, p_resp, None, p_leg, None)
    d_resp = decode.complete(prompt, max_tokens, p_resp.params, stream=stream_decode)
    p2, d2 = settled_metrics(prefill), settled_metrics(decode)
    return PDTurn(list(prompt), sent, p_resp, d_resp, p_leg, LegDelta(p2 - p1, d2 - d1))
