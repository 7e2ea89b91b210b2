"""Building blocks the conformance scenarios share: turns with engineered lengths,
pull/no-pull evidence from metric deltas, waits on a metric.

Lengths are derived from the backend's block size and threshold so one scenario
means the same thing on every backend (block 128 on vLLM CPU, 16 on GPU).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

from bidir_kv.client import ClientError, Completion, PDTurn, TransportError, run_pd_turn
from bidir_kv.protocol import KVTransferParams
from bidir_kv.scrape import (
    CACHED_BY_SOURCE,
    NIXL_BYTES,
    NIXL_FAILED,
    NIXL_XFERS,
    MetricsSnapshot,
    tokens_by_source,
)
from bidir_kv.testing.backends import PDBackend, PromptFactory
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.testing.poll import wait_for

__all__ = [
    "ANSWER_WITHIN",
    "Pulled",
    "complete_watching",
    "evidence",
    "expire_soon",
    "queue_state",
    "two_turns",
    "wait_metric_increase",
]


def wait_metric_increase(
    client: EngineClient, before: MetricsSnapshot, name: str, timeout: float, **labels: str
) -> float:
    """Poll ``/metrics`` until counter ``name`` rose above ``before``; return the delta."""

    def delta() -> float | None:
        d = client.metrics().value(name, **labels) - before.value(name, **labels)
        return d if d > 0 else None

    # a real vLLM exposition is ~100 KB: scrape it five times a second, not fifty
    return wait_for(delta, timeout, f"{name} to increase on {client.node.name}", interval=0.2)


@dataclass(frozen=True)
class Pulled:
    """What one P leg did, read from metric deltas (the mechanism, not timings)."""

    local_compute: int
    local_cache_hit: int
    external: int
    bytes: float
    transfers: float
    failed: float
    p2p: int = 0  # vllm:prompt_tokens_cached_by_source{source="p2p"}: the connector's hits

    @property
    def pulled(self) -> bool:
        return self.external > 0 and self.bytes > 0


def evidence(delta: MetricsSnapshot) -> Pulled:
    src = tokens_by_source(delta)
    return Pulled(
        local_compute=src["local_compute"],
        local_cache_hit=src["local_cache_hit"],
        external=src["external_kv_transfer"],
        bytes=delta.value(NIXL_BYTES),
        transfers=delta.value(NIXL_XFERS),
        failed=delta.value(NIXL_FAILED),
        p2p=int(delta.value(CACHED_BY_SOURCE, source="p2p")),
    )


def two_turns(
    pd: PDBackend,
    prompts: PromptFactory,
    first_len: int,
    gen: int,
    new_tokens: int,
    *,
    prefill: EngineClient | None = None,
) -> tuple[PDTurn, PDTurn]:
    """Turn 1 (miss) then turn 2 (D's dict to P) of a token-exact continuation."""
    p = prefill or pd.prefill
    t1 = run_pd_turn(p, pd.decode, prompts.prompt(first_len), gen)
    assert t1.d is not None and t1.d.ok, f"turn 1 failed: {t1.p.error or t1.d}"
    assert t1.d.params is not None, "D returned no kv_transfer_params on turn 1"
    t2 = run_pd_turn(p, pd.decode, [*t1.sequence, *prompts.tokens(new_tokens)], gen, t1.d.params)
    return t1, t2


def queue_state(client: EngineClient) -> dict[str, float]:
    """Running / waiting / deferred request gauges: the evidence of a stall.

    A request parked for a KV load that never comes shows as waiting with reason
    ``deferred`` (vLLM's ``vllm:num_requests_waiting_by_reason``).
    """
    snap = client.metrics(("vllm:num_requests_running", "vllm:num_requests_waiting"))
    return {
        "running": snap.value("vllm:num_requests_running"),
        "waiting": snap.value("vllm:num_requests_waiting"),
        "deferred": snap.value("vllm:num_requests_waiting_by_reason", reason="deferred"),
    }


# How long a scenario waits for an answer that must come (a decline, a feature-off P)
# before calling the request stalled: a 500-token prompt is answered in under a second
# on an idle machine and in under 15 s on a loaded 2-core one; vLLM's stalls are
# permanent (docs/protocol.md §7.4), so waiting longer only costs CI time.
ANSWER_WITHIN = 45.0


def complete_watching(
    client: EngineClient,
    prompt: list[int],
    max_tokens: int,
    params: KVTransferParams,
    timeout: float,
    interval: float = 1.0,
) -> tuple[Completion | TransportError, dict[str, float]]:
    """Send a request and sample the node's queue while it is pending.

    Returns the response (or the :class:`TransportError` when none came within
    ``timeout``) and the maxima of running / waiting / deferred seen during the wait:
    a request that never runs but sits deferred until the client gives up is a stall,
    however loaded the machine is.
    """
    box: dict[str, Completion | TransportError] = {}

    def send() -> None:
        try:
            box["r"] = client.complete(prompt, max_tokens, params, timeout=timeout)
        except TransportError as exc:
            box["r"] = exc

    th = threading.Thread(target=send, daemon=True)
    peak = {"running": 0.0, "waiting": 0.0, "deferred": 0.0, "samples": 0.0}
    th.start()
    while th.is_alive():
        with contextlib.suppress(ClientError):
            for key, value in queue_state(client).items():
                peak[key] = max(peak[key], value)
            peak["samples"] += 1
        th.join(interval)
    return box["r"], peak


def expire_soon(params: KVTransferParams, seconds: float) -> KVTransferParams:
    """D's dict with its deadline moved to ``seconds`` from now (same-host clock).

    P's decline rule only looks at this exported value, so this is how a late turn
    looks to P, without waiting out D's TTL.
    """
    return params.with_fields(remote_blocks_expiry_time=time.perf_counter() + seconds)
