"""HTTP clients for one node (engine, router, any OpenAI-style server), sync and async.

:class:`NodeClient` and :class:`AsyncNodeClient` share :class:`_NodeBase`: the base
URL, default headers and timeout, how a request is built and how an answer becomes a
:class:`Reply` or a :class:`~bidir_kv.client.result.Completion`; they differ only in
how bytes are awaited. Both use httpx with ``follow_redirects=False`` and take a
per-request ``timeout`` (seconds each connect, read or write may wait; ``None`` keeps
the client's). Every call goes through :func:`~bidir_kv.client.errors.translated`.

A client is given URLs, never topology nodes: it sits below ``topology``, ``bench``,
``doctor``, ``campaign`` and ``testing``, which all talk to nodes through it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import ssl
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import httpx

from bidir_kv.client.errors import (
    BODY_EXCERPT,
    HTTPStatusError,
    MalformedResponse,
    TransportError,
    translated,
)
from bidir_kv.client.result import Completion, StreamCut, StreamReader, read_body, read_error
from bidir_kv.client.sse import aiter_data, iter_data
from bidir_kv.scrape import MetricsSnapshot, parse_metrics

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "DEFAULT_TIMEOUT",
    "AsyncNodeClient",
    "NodeClient",
    "Reply",
    "fetch",
    "get_json",
    "read_reply",
    "scrape",
]

DEFAULT_TIMEOUT = 120.0
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
_JSON = {"Content-Type": "application/json"}


@functools.cache
def _tls() -> ssl.SSLContext:
    """One verifying TLS context for every client (building one costs tens of ms)."""
    return ssl.create_default_context()


@dataclass
class Reply:
    """A whole non-streamed answer, whatever its status."""

    status: int
    url: str
    content: bytes
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def raise_for_status(self) -> Reply:
        if not self.ok:
            raise HTTPStatusError(self.status, self.text[:BODY_EXCERPT], url=self.url)
        return self

    def json(self) -> Any:
        """The decoded body; :class:`MalformedResponse` when it is not JSON."""
        try:
            return json.loads(self.content)
        except ValueError as exc:
            raise MalformedResponse(
                f"answer is not JSON: {self.content[:80]!r}", url=self.url
            ) from exc

    def json_object(self) -> dict[str, Any]:
        """The decoded body, which must be a JSON object."""
        obj = self.json()
        if not isinstance(obj, dict):
            raise MalformedResponse(
                f"answer is not a JSON object: {self.content[:80]!r}", url=self.url
            )
        return obj


def read_reply(reply: Reply, stream: bool) -> Completion:
    """A :class:`Completion` from an answer already read whole (a test that also needs
    the raw bytes); a stream's body goes through the same reader as a live one."""
    out = Completion(status=reply.status, url=reply.url, stream=stream)
    if not reply.ok:
        return read_error(out, reply.content)
    if not stream:
        return read_body(out, reply.content)
    reader = StreamReader(out)
    for data in iter_data([reply.content]):
        reader.feed(data, 0.0)
    return reader.finish(0.0)


def _metrics(text: str, names: Sequence[str] | None) -> MetricsSnapshot:
    """Parse an exposition; with ``names`` only those samples (vLLM's is ~100 KB of
    histograms, and parsing it all is slow on a busy machine)."""
    if names is not None:
        keep = tuple(names)
        text = "\n".join(ln for ln in text.splitlines() if ln.startswith(keep)) + "\n"
    return MetricsSnapshot(parse_metrics(text))


@contextlib.contextmanager
def _cut_streams(out: Completion) -> Iterator[None]:
    """A transport failure after a stream's 2xx headers is a :class:`StreamCut` that
    keeps what the stream delivered (a test of a node dying mid-answer reads it)."""
    try:
        yield
    except TransportError as exc:
        if out.stream and 200 <= out.status < 300:
            raise StreamCut(str(exc), url=exc.url, partial=out) from exc
        raise


class _NodeBase:
    """What the sync and async clients share: everything but waiting for bytes."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.headers = dict(headers or {})
        self._parsed: dict[str, httpx.URL] = {}  # path -> URL, parsed once (per-request cost)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url})"

    def _options(self) -> dict[str, Any]:
        return {
            "timeout": self.timeout,
            "follow_redirects": False,
            "verify": _tls(),
            "headers": self.headers,
        }

    def _target(self, path: str) -> str:
        return self.url + path

    def _build(
        self,
        http: httpx.Client | httpx.AsyncClient,
        method: str,
        path: str,
        body: Any,
        content: bytes | None,
        headers: Mapping[str, str] | None,
        timeout: float | None,
    ) -> httpx.Request:
        hdrs = dict(headers or {})
        if body is not None:
            content = json.dumps(body).encode()
            hdrs = {**_JSON, **hdrs}
        url = self._parsed.get(path)
        if url is None:
            url = self._parsed[path] = httpx.URL(self._target(path))
        return http.build_request(
            method,
            url,
            content=content,
            headers=hdrs,
            timeout=self.timeout if timeout is None else timeout,
        )

    @staticmethod
    def _reply(resp: httpx.Response, content: bytes) -> Reply:
        return Reply(resp.status_code, str(resp.url), content, dict(resp.headers))

    @staticmethod
    def _start(url: str, stream: bool) -> Completion:
        return Completion(status=0, url=url, stream=stream, start=time.perf_counter())


class NodeClient(_NodeBase):
    """Blocking client of one node; thread-safe, one connection pool. ``transport``
    replaces the network (a unit test's ``httpx.MockTransport``)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(url, timeout=timeout, headers=headers)
        self._http = httpx.Client(transport=transport, **self._options())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Reply:
        """One request, the whole answer read, any status returned."""
        url = self._target(path)
        with translated(url):
            req = self._build(self._http, method, path, json, content, headers, timeout)
            resp = self._http.send(req)
            return self._reply(resp, resp.read())

    def get(self, path: str, *, timeout: float | None = None) -> Reply:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: Any = None, *, timeout: float | None = None) -> Reply:
        return self.request("POST", path, json=body, timeout=timeout)

    def get_json(self, path: str, *, timeout: float | None = None) -> Any:
        """GET, require a 2xx, return the decoded body."""
        return self.get(path, timeout=timeout).raise_for_status().json()

    def metrics(
        self, names: Sequence[str] | None = None, *, timeout: float | None = None
    ) -> MetricsSnapshot:
        """Scrape ``/metrics`` (only ``names`` when given)."""
        return _metrics(self.get("/metrics", timeout=timeout).raise_for_status().text, names)

    def complete(
        self,
        body: Mapping[str, Any],
        *,
        path: str = COMPLETIONS_PATH,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Completion:
        """POST a completion (or, with ``path=CHAT_PATH``, chat) body; streamed when the
        body says ``stream``. A non-2xx answer is returned (``raise_for_status``)."""
        stream = bool(body.get("stream"))
        url = self._target(path)
        out = self._start(url, stream)
        with _cut_streams(out), translated(url):
            req = self._build(self._http, "POST", path, body, None, headers, timeout)
            resp = self._http.send(req, stream=True)
            try:
                out.status = resp.status_code
                if not resp.is_success:
                    read_error(out, resp.read())
                elif not stream:
                    read_body(out, resp.read())
                else:
                    reader = StreamReader(out)
                    for data in iter_data(resp.iter_bytes()):
                        reader.feed(data, time.perf_counter())
                    return reader.finish(time.perf_counter())
            finally:
                resp.close()
        out.elapsed = time.perf_counter() - out.start
        return out


class AsyncNodeClient(_NodeBase):
    """The same client for asyncio callers (bench, campaign); one pool, no connection cap."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(url, timeout=timeout, headers=headers)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._http = httpx.AsyncClient(limits=limits, transport=transport, **self._options())

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Reply:
        url = self._target(path)
        with translated(url):
            req = self._build(self._http, method, path, json, content, headers, timeout)
            resp = await self._http.send(req)
            return self._reply(resp, await resp.aread())

    async def get(self, path: str, *, timeout: float | None = None) -> Reply:
        return await self.request("GET", path, timeout=timeout)

    async def post(self, path: str, body: Any = None, *, timeout: float | None = None) -> Reply:
        return await self.request("POST", path, json=body, timeout=timeout)

    async def get_json(self, path: str, *, timeout: float | None = None) -> Any:
        return (await self.get(path, timeout=timeout)).raise_for_status().json()

    async def metrics(
        self, names: Sequence[str] | None = None, *, timeout: float | None = None
    ) -> MetricsSnapshot:
        reply = (await self.get("/metrics", timeout=timeout)).raise_for_status()
        return _metrics(reply.text, names)

    @contextlib.asynccontextmanager
    async def open_stream(
        self, path: str, body: Mapping[str, Any], *, timeout: float | None = None
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """POST ``body`` and yield its ``data:`` payloads as they come; leaving the block
        closes the connection, read to the end or not (a client that goes away).
        A non-2xx answer raises :class:`HTTPStatusError`."""
        url = self._target(path)
        with translated(url):
            req = self._build(self._http, "POST", path, body, None, None, timeout)
            resp = await self._http.send(req, stream=True)
            try:
                if not resp.is_success:
                    text = (await resp.aread()).decode(errors="replace")
                    raise HTTPStatusError(resp.status_code, text, url=url)
                yield aiter_data(resp.aiter_bytes())
            finally:
                await resp.aclose()

    async def complete(
        self,
        body: Mapping[str, Any],
        *,
        path: str = COMPLETIONS_PATH,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Completion:
        """:meth:`NodeClient.complete`, awaited."""
        stream = bool(body.get("stream"))
        url = self._target(path)
        out = self._start(url, stream)
        with _cut_streams(out), translated(url):
            req = self._build(self._http, "POST", path, body, None, headers, timeout)
            resp = await self._http.send(req, stream=True)
            try:
                out.status = resp.status_code
                if not resp.is_success:
                    read_error(out, await resp.aread())
                elif not stream:
                    read_body(out, await resp.aread())
                else:
                    reader = StreamReader(out)
                    async for data in aiter_data(resp.aiter_bytes()):
                        reader.feed(data, time.perf_counter())
                    return reader.finish(time.perf_counter())
            finally:
                await resp.aclose()
        out.elapsed = time.perf_counter() - out.start
        return out


# ---- one-off calls (a client per call; the TLS context is shared) ---------------------


def fetch(
    url: str,
    *,
    method: str = "GET",
    json: Any = None,
    content: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 10.0,
) -> Reply:
    """One request to a full URL, any status returned (``content``: raw body bytes,
    for a test that sends what a JSON encoder would not)."""
    with NodeClient(url, timeout=timeout) as client:
        return client.request(method, "", json=json, content=content, headers=headers)


def get_json(url: str, *, timeout: float = 10.0) -> Any:
    """GET a full URL, require a 2xx, return the decoded body."""
    return fetch(url, timeout=timeout).raise_for_status().json()


def scrape(
    base_url: str, *, timeout: float = 10.0, names: Sequence[str] | None = None
) -> MetricsSnapshot:
    """GET ``{base_url}/metrics`` and parse it (only ``names`` when given)."""
    with NodeClient(base_url, timeout=timeout) as client:
        return client.metrics(names)
