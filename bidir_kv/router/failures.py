"""Typed failures of the P and D legs, and the HTTP answers a client gets for them.

A failure's metric label is ``<leg>_<cause>`` (``prefill_timeout``,
``decode_mid_stream``); the enums carry those exact strings so ``/metrics``
keeps its label values while the code compares members, not strings.
"""

from __future__ import annotations

import enum

from aiohttp import web

from bidir_kv.errors import BidirKVError, RouterError
from bidir_kv.router.metrics import RouterMetrics
from bidir_kv.router.upstreams import UpstreamPool

__all__ = [
    "JSON",
    "Cause",
    "Leg",
    "UpstreamFailure",
    "error_response",
    "error_response_for",
    "failure_label",
    "unavailable_response",
]

JSON = "application/json"


class Leg(enum.Enum):
    """Which half of a turn failed."""

    PREFILL = "prefill"
    DECODE = "decode"


class Cause(enum.Enum):
    """Why a leg failed; the value is the metric label suffix."""

    UNREACHABLE = "unreachable"  # the node could not be reached at all
    TIMEOUT = "timeout"
    HTTP = "http"  # the node answered with a non-2xx status
    BAD_RESPONSE = "bad_response"  # a 2xx answer we cannot use
    UNSUPPORTED = "unsupported"  # a request shape the router cannot handle this way
    MID_STREAM = "mid_stream"  # D's answer broke off after it started
    PULL = "pull"  # D could not pull P's blocks (it answered 5xx before any byte)


def failure_label(leg: Leg, cause: Cause) -> str:
    """The ``cause`` label of the errors and fallbacks counters."""
    return f"{leg.value}_{cause.value}"


class UpstreamFailure(RouterError):
    """A call to an engine failed; ``status``/``body`` are what the node said, if anything.

    The client is answered 502, or 504 when the node was too slow (``Cause.TIMEOUT``).
    """

    def __init__(
        self, cause: Cause, message: str, status: int | None = None, body: bytes | None = None
    ) -> None:
        super().__init__(message)
        self.cause = cause
        self.status = status
        self.body = body
        if cause is Cause.TIMEOUT:
            self.http_status, self.error_type = 504, "GatewayTimeout"

    @property
    def unreachable(self) -> bool:
        """The node could not be reached at all (not: it answered badly or slowly)."""
        return self.cause is Cause.UNREACHABLE


def error_response(status: int, message: str, kind: str) -> web.Response:
    """An OpenAI-style error body."""
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status)


def error_response_for(exc: BidirKVError) -> web.Response:
    """The router's one translation of our errors into HTTP answers (docs/architecture.md,
    Errors): the status and type the error carries, and its message."""
    return error_response(exc.http_status, str(exc), exc.error_type)


def unavailable_response(
    metrics: RouterMetrics, *down: UpstreamPool, problem: str | None = None
) -> web.Response:
    """503 naming each pool without a healthy node and why its nodes are down, or
    ``problem`` (healthy nodes that cannot be paired)."""
    problems = [f"no healthy {pool.role} node (down: {pool.down_description()})" for pool in down]
    if problem is not None:
        problems.append(problem)
    metrics.errors.labels("unavailable").inc()
    return error_response(503, "; ".join(problems), "ServiceUnavailable")
