"""Clients sharing one P: the wait for each other's prefill compute, replayed from the run.

The per-request cost model (``calibrate``) prices one request alone. With two or
more clients on one P a request also waits while P computes another's prefill.
This term is derived, not fitted: the arrivals are the run's own request start
times (the client records), the work of each request is the fitted recompute of
the tokens P computed for it, and P serves that work first come, first served.

Assumption (docs/profiles.md §6): P computes one prefill at a time. vLLM's engine
core runs one step at a time and a request that arrives during a step waits for
the next; two prefills that do share a step (chunked prefill, token budget) finish
together, no earlier for the first than the queue would make them. The router, the
frontend and a pull are latency that holds none of P's compute. With one client no
two requests overlap and the term is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bidir_kv.bench.stats import RequestRecord
from bidir_kv.policy import pull_decision

__all__ = ["Arrival", "arrivals", "closed_loop_wait_us", "fcfs_waits", "mean_wait_us"]


@dataclass(frozen=True)
class Arrival:
    """One request at P: when it reached the router, what P computes, what comes first."""

    start_us: float
    compute_tokens: float
    pulled_tokens: float  # the pull before the compute: latency, not P's work


def _pulled(rec: RequestRecord, block_size: int, threshold: int) -> int:
    history = round(max(0.0, rec.input_num_tokens * rec.approx_cached_percent / 100.0))
    return pull_decision(
        prompt_tokens=rec.prompt_tokens or rec.input_num_tokens,
        local_hit_tokens=0,
        remote_num_tokens=history,
        block_size=block_size,
        threshold=threshold,
    ).tokens


def arrivals(
    records: Sequence[RequestRecord],
    *,
    computed_total: float,
    pulled_total: float,
    block_size: int,
    threshold: int,
) -> list[Arrival]:
    """The point's ok requests as arrivals at P, scaled to P's own token counters.

    Per request the split comes from the record (prompt tokens, the history D
    holds); the totals are P's ``prompt_tokens_by_source`` counters, so that the
    replay computes exactly the tokens P reports having computed and pulled.
    """
    ok = [r for r in records if r.ok]
    pulled = [_pulled(r, block_size, threshold) if pulled_total > 0 else 0 for r in ok]
    computed = [
        (r.prompt_tokens or r.input_num_tokens) - n for r, n in zip(ok, pulled, strict=True)
    ]
    c_scale = computed_total / sum(computed) if sum(computed) > 0 else 0.0
    p_scale = pulled_total / sum(pulled) if sum(pulled) > 0 else 0.0
    return [
        Arrival(r.start_time_ms * 1e3, c * c_scale, n * p_scale)
        for r, c, n in zip(ok, computed, pulled, strict=True)
    ]


def fcfs_waits(
    requests: Sequence[Arrival], us_per_token: float, pull_latency_us: Sequence[float]
) -> list[float]:
    """Per request, µs spent waiting for P's compute held by earlier requests."""
    ready = [a.start_us + lat for a, lat in zip(requests, pull_latency_us, strict=True)]
    order = sorted(range(len(requests)), key=lambda i: ready[i])
    waits = [0.0] * len(requests)
    free_at = float("-inf")
    for i in order:
        begin = max(ready[i], free_at)
        waits[i] = begin - ready[i]
        free_at = begin + requests[i].compute_tokens * us_per_token
    return waits


def mean_wait_us(
    requests: Sequence[Arrival], us_per_token: float, pull_us: float = 0.0, pulls: float = 0.0
) -> float:
    """Mean wait per request; a request that pulled reaches P's compute ``pull_us`` later.

    ``pulls`` is the mean number of pulls per request of the point (pulled tokens
    per request over tokens per pull), so one pull's latency scales with its share.
    """
    if not requests:
        return 0.0
    mean_pulled = sum(a.pulled_tokens for a in requests) / len(requests)
    latency = [
        pull_us * pulls * (a.pulled_tokens / mean_pulled) if mean_pulled > 0 else 0.0
        for a in requests
    ]
    waits = fcfs_waits(requests, us_per_token, latency)
    return sum(waits) / len(waits)


def closed_loop_wait_us(service_us: float, rest_us: float, clients: int) -> float:
    """Mean wait for the other clients' compute on one P when no arrivals are known.

    Each client runs a closed loop: a prefill of ``service_us`` on P, then
    ``rest_us`` elsewhere (the answer's decode on D, think time) before its next
    request. *Assumption*: the clients' phases are independent, so another client is
    in its prefill with probability ``S / (S + W + R)`` and then has half of it left;
    ``W = (clients − 1) × S² / (2 (S + W + R))``, solved by iteration.
    """
    if clients <= 1 or service_us <= 0:
        return 0.0
    wait = 0.0
    for _ in range(60):
        wait = (clients - 1) * service_us**2 / (2 * (service_us + wait + rest_us))
    return wait
