"""Token-id completions against one engine, and one turn driven through P then D.

:class:`TokenClient` sends ``/v1/completions`` the way the protocol is checked:
a token-id prompt, ``temperature 0``, ``ignore_eos`` and ``return_token_ids``, so
tokenization can never blur a comparison. :func:`run_pd_turn` drives one turn
straight through P and D (no router), with ``/metrics`` deltas around each leg; the
flow is docs/vllm-cpu.md §7.4 / docs/protocol.md §1. The conformance scenarios and
``bidir-kv doctor``'s live probe use the same two.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from bidir_kv.client.node import COMPLETIONS_PATH, DEFAULT_TIMEOUT, NodeClient
from bidir_kv.client.result import Completion
from bidir_kv.protocol import KVTransferParams
from bidir_kv.scrape import WATCHED, MetricsSnapshot, tokens_by_source

__all__ = [
    "LegDelta",
    "PDTurn",
    "TokenClient",
    "run_pd_turn",
    "settled_metrics",
    "token_body",
]


def token_body(
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    params: KVTransferParams | None = None,
    *,
    stream: bool = False,
    conversation_id: str | None = None,
    include_usage: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A greedy token-id ``/v1/completions`` body (``include_usage`` asks a stream for it)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if stream and include_usage:
        body["stream_options"] = {"include_usage": True}
    if params is not None:
        body["kv_transfer_params"] = params.to_dict()
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    body.update(extra or {})
    return body


class TokenClient:
    """Token-id completions and ``/metrics`` of one engine (P, D or a reference)."""

    def __init__(self, url: str, model: str = "tiny", timeout: float = DEFAULT_TIMEOUT) -> None:
        self.http = NodeClient(url, timeout=timeout)
        self.url = self.http.url
        self.model = model
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url})"

    def _check_usable(self) -> None:
        """Called before every request (a subclass may refuse)."""

    def body(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        params: KVTransferParams | None = None,
        *,
        stream: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return token_body(self.model, prompt, max_tokens, params, stream=stream, extra=extra)

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
        """One completion; a non-2xx answer is returned, no answer raises
        :class:`~bidir_kv.client.errors.TransportError`."""
        body = self.body(prompt, max_tokens, params, stream=stream, extra=extra)
        return self.post(COMPLETIONS_PATH, body, timeout=timeout)

    def post(self, path: str, body: Mapping[str, Any], timeout: float | None = None) -> Completion:
        self._check_usable()
        return self.http.complete(body, path=path, timeout=timeout)

    def metrics(self, names: Sequence[str] | None = None) -> MetricsSnapshot:
        """Scrape ``/metrics``; with ``names`` only those samples are parsed."""
        self._check_usable()
        return self.http.metrics(names)


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


def settled_metrics(
    client: TokenClient, timeout: float = 5.0, interval: float = 0.05
) -> MetricsSnapshot:
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
    prefill: TokenClient,
    decode: TokenClient,
    prompt: Sequence[int],
    max_tokens: int,
    previous: KVTransferParams | None = None,
    *,
    stream_decode: bool = False,
    decode_host: str | None = None,
    prefill_window: AbstractContextManager[object] | None = None,
) -> PDTurn:
    """P leg (``max_tokens=1``, miss dict or D's previous dict) then D leg with P's dict.

    ``decode_host`` rewrites ``remote_host`` like a router does; ``None`` keeps it.
    If P answers non-2xx or without params, the D leg is skipped (``d`` is ``None``).
    ``prefill_window`` is entered right before P's request and left right after it, and
    around nothing else (e.g. NIC counters that must see P's read of D alone).
    """
    sent = KVTransferParams.miss() if previous is None else previous.for_prefill_hit(decode_host)
    p0, d0 = settled_metrics(prefill), settled_metrics(decode)
    with prefill_window or nullcontext():
        p_resp = prefill.complete(prompt, 1, sent)
    p1, d1 = settled_metrics(prefill), settled_metrics(decode)
    p_leg = LegDelta(p1 - p0, d1 - d0)
    if not p_resp.ok or p_resp.params is None:
        return PDTurn(list(prompt), sent, p_resp, None, p_leg, None)
    d_resp = decode.complete(prompt, max_tokens, p_resp.params, stream=stream_decode)
    p2, d2 = settled_metrics(prefill), settled_metrics(decode)
    return PDTurn(list(prompt), sent, p_resp, d_resp, p_leg, LegDelta(p2 - p1, d2 - d1))
