"""Typed failures of a conversation with a node, and the one place they are made.

Every HTTP call of :mod:`bidir_kv.client` goes through :func:`translated`, the only
code that knows httpx's exception tree; callers catch :class:`ClientError` (or one of
its three kinds) and never see a library exception or a made-up status.

- :class:`TransportError`: no HTTP answer at all (connection refused or reset, a
  timeout, a stream cut mid-way); :class:`RequestTimeout` is the timeout case.
- :class:`HTTPStatusError`: an answer whose status is not 2xx, with the status and an
  excerpt of the body. Requests return such answers as results; ``raise_for_status()``
  on the result turns them into this error, so a test that expects a 4xx can still
  look at the status.
- :class:`MalformedResponse`: a 2xx answer the client cannot read (invalid JSON, JSON
  of the wrong type, invalid ``kv_transfer_params``, a stream that ends without data).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx

from bidir_kv.errors import BidirKVError

__all__ = [
    "BODY_EXCERPT",
    "ClientError",
    "HTTPStatusError",
    "MalformedResponse",
    "RequestTimeout",
    "TransportError",
    "translated",
]

BODY_EXCERPT = 2000  # characters of an error body kept on results and errors


class ClientError(BidirKVError):
    """A request to a node that did not give a usable answer; ``url`` names it."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        self.url = url
        super().__init__(f"{message} ({url})" if url else message)


class TransportError(ClientError):
    """No HTTP answer: refused, reset, cut mid-stream, or not in time."""


class RequestTimeout(TransportError):
    """The answer (or its next byte) did not come within the request's timeout."""


class HTTPStatusError(ClientError):
    """A non-2xx answer: ``status`` and ``body`` (an excerpt of the body text)."""

    def __init__(self, status: int, body: str, *, url: str | None = None) -> None:
        self.status = status
        self.body = body[:BODY_EXCERPT]
        super().__init__(f"HTTP {status}: {self.body[:300]}", url=url)


class MalformedResponse(ClientError):
    """A 2xx answer that cannot be read: bad JSON, wrong shape, a stream without data."""


@contextlib.contextmanager
def translated(url: str) -> Iterator[None]:
    """Run a request (sync or awaited inside the block) and turn httpx's failures into
    ours. The one translation point: no other module catches an httpx exception."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise RequestTimeout(f"{type(exc).__name__}: {exc or 'timed out'}", url=url) from exc
    except httpx.TransportError as exc:
        raise TransportError(f"{type(exc).__name__}: {exc}", url=url) from exc
    except httpx.HTTPStatusError as exc:  # only if someone called httpx's raise_for_status
        raise HTTPStatusError(exc.response.status_code, exc.response.text, url=url) from exc
    except httpx.HTTPError as exc:  # a body that does not decode, and the like
        raise MalformedResponse(f"{type(exc).__name__}: {exc}", url=url) from exc
    except httpx.InvalidURL as exc:
        raise ClientError(f"invalid URL: {exc}", url=url) from exc
