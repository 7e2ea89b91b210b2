"""Router fixtures: in-process stub stacks (unit tier), router processes and Redis.

Loaded by the plugin; suites use the fixtures ``redis_server`` and
``router_process`` and the async context manager :class:`StubStack`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bidir_kv.client import CHAT_PATH, AsyncNodeClient, NodeClient, read_reply, scrape
from bidir_kv.client.sse import iter_data
from bidir_kv.config import KVTransferConfig
from bidir_kv.launch.process import ManagedProcess, free_port, wait_http_ok
from bidir_kv.router.app import FLOW_KEY, build_app
from bidir_kv.router.flow import RouterFlow
from bidir_kv.router.settings import RouterSettings
from bidir_kv.router.store import ConversationStore
from bidir_kv.testing.doubles.stub_engine import StubEngine
from bidir_kv.testing.engines import kv_config
from bidir_kv.testing.gating import skip_or_fail
from bidir_kv.topology.base import BackendUnavailable, EngineSpec, RouterSpec, TopologySpec
from bidir_kv.topology.redis_server import RedisServer

_conversations = itertools.count()

__all__ = [
    "ChatResult",
    "RouterProcess",
    "StubStack",
    "bidirectional_config",
    "chat",
    "conversation_id",
    "counter",
    "emulated_router_topology",
    "long_opening",
    "redis_server",
    "router_counter",
    "router_process",
    "start_router_process",
]


async def _serve(app: web.Application, host: str = "127.0.0.1") -> tuple[web.AppRunner, int]:
    # what still runs when a test ends is a delay the test set up (a slow P, a hung D):
    # cancelled at once, not waited for (aiohttp waits shutdown_timeout for handlers)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.05)
    await runner.setup()
    port = free_port(host)
    await web.TCPSite(runner, host, port).start()
    return runner, port


@dataclass
class StubStack:
    """Stub P/D engines and a router, all real HTTP servers on loopback, in this loop."""

    num_prefill: int = 1
    num_decode: int = 1
    config: RouterSettings = field(default_factory=RouterSettings)
    store: ConversationStore | None = None
    health_interval: float = 0.0
    prefill: list[StubEngine] = field(default_factory=list)
    decode: list[StubEngine] = field(default_factory=list)
    prefill_ports: list[int] = field(default_factory=list)
    decode_ports: list[int] = field(default_factory=list)
    url: str = ""
    app: web.Application | None = None
    client: AsyncNodeClient | None = None  # to the router
    session: aiohttp.ClientSession | None = None  # for the router's own pieces under test
    _runners: list[web.AppRunner] = field(default_factory=list)

    @property
    def flow(self) -> RouterFlow:
        assert self.app is not None
        return self.app[FLOW_KEY]

    async def stop_engine(self, role: str, index: int) -> None:
        """Take one engine off the network (its port then refuses connections)."""
        runners = (
            self._runners[: self.num_prefill]
            if role == "prefill"
            else self._runners[self.num_prefill : self.num_prefill + self.num_decode]
        )
        await runners[index].cleanup()

    async def __aenter__(self) -> StubStack:
        try:
            for i in range(self.num_prefill):
                eng = StubEngine(name=f"p{i}", side_port=5600 + i)
                runner, port = await _serve(eng.app())
                self.prefill.append(eng)
                self.prefill_ports.append(port)
                self._runners.append(runner)
            for i in range(self.num_decode):
                eng = StubEngine(name=f"d{i}", side_port=5700 + i)
                runner, port = await _serve(eng.app())
                self.decode.append(eng)
                self.decode_ports.append(port)
                self._runners.append(runner)
            settings = replace(
                self.config,
                prefill_hosts=("127.0.0.1",) * self.num_prefill,
                prefill_ports=tuple(self.prefill_ports),
                decode_hosts=("127.0.0.1",) * self.num_decode,
                decode_ports=tuple(self.decode_ports),
                health_interval=self.health_interval,
            )
            self.app = build_app(settings, store=self.store)
            runner, port = await _serve(self.app)
            self._runners.append(runner)
            self.url = f"http://127.0.0.1:{port}"
            self.client = AsyncNodeClient(self.url)
            self.session = aiohttp.ClientSession()
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.session is not None:
            await self.session.close()
        for runner in reversed(self._runners):
            with contextlib.suppress(Exception):
                await runner.cleanup()
        self._runners.clear()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def post(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[int, Any, list[bytes]]:
        """POST through the router: (status, JSON body or None, raw SSE data payloads)."""
        assert self.client is not None
        reply = await self.client.request("POST", path, json=body, headers=headers)
        if reply.headers.get("content-type", "").startswith("text/event-stream"):
            return reply.status, None, [d.strip() for d in iter_data([reply.content])]
        return reply.status, reply.json(), []


def counter(flow: RouterFlow, name: str, **labels: str) -> float:
    """Current value of one of the router's counters (``_total`` sample)."""
    value = flow.metrics.registry.get_sample_value(f"bidir_kv_router_{name}_total", labels)
    return 0.0 if value is None else value


# ---- processes ----------------------------------------------------------------


@pytest.fixture
def redis_server(request: pytest.FixtureRequest, run_dir: Path) -> Iterator[RedisServer]:
    """A private redis-server on a free loopback port (skip/fail naming the binary)."""
    server = RedisServer(run_dir)
    try:
        server.start()
    except BackendUnavailable as exc:
        server.stop()
        skip_or_fail(request.config, "integration", str(exc))
    try:
        yield server
    finally:
        server.stop()


@dataclass
class RouterProcess:
    """A ``bidir-kv proxy`` child process."""

    proc: ManagedProcess
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        try:
            return self.proc.log_path.read_text(errors="replace")
        except OSError:
            return ""


def start_router_process(
    run_dir: Path,
    prefill: Sequence[tuple[str, int]],
    decode: Sequence[tuple[str, int]],
    extra: Sequence[str] = (),
    port: int | None = None,
    name: str = "router",
    timeout: float = 20.0,
    ready_path: str = "/metrics",
) -> RouterProcess:
    """Start ``bidir-kv proxy`` on loopback and wait until ``ready_path`` answers 200.

    ``/metrics`` (the default) answers as soon as it serves; ``/health`` only once it
    sees a healthy P and D.
    """
    port = port or free_port()
    argv = [
        sys.executable,
        "-m",
        "bidir_kv",
        "proxy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefiller-hosts",
        *[h for h, _ in prefill],
        "--prefiller-ports",
        *[str(p) for _, p in prefill],
        "--decoder-hosts",
        *[h for h, _ in decode],
        "--decoder-ports",
        *[str(p) for _, p in decode],
        *extra,
    ]
    proc = ManagedProcess(name, argv, run_dir / f"{name}-{port}.log").start()
    try:
        wait_http_ok(f"http://127.0.0.1:{port}{ready_path}", timeout, alive=proc)
    except BaseException:
        proc.stop()
        raise
    return RouterProcess(proc, port)


@pytest.fixture
def router_process(run_dir: Path) -> Iterator[Callable[..., RouterProcess]]:
    """Factory fixture: every router it starts is stopped at teardown."""
    started: list[RouterProcess] = []

    def start(*args: Any, **kwargs: Any) -> RouterProcess:
        rp = start_router_process(run_dir, *args, **kwargs)
        started.append(rp)
        return rp

    try:
        yield start
    finally:
        for rp in started:
            rp.proc.stop()


# ---- a synchronous client for the integration tier ------------------------------


@dataclass
class ChatResult:
    """One chat turn as a router test sees it: the raw bytes (what the router let
    through) next to the text the client's one reader found in them."""

    status: int
    text: str
    raw: bytes
    body: Any = None

    @property
    def error(self) -> Any:
        if isinstance(self.body, dict) and "error" in self.body:
            return self.body["error"]
        for data in iter_data([self.raw]):
            if data.startswith(b"{") and b'"error"' in data:
                obj = json.loads(data)
                if "error" in obj:
                    return obj["error"]
        return None


def chat(
    url: str,
    messages: Sequence[dict[str, Any]],
    conv: str | None = None,
    *,
    headers: dict[str, str] | None = None,
    stream: bool = True,
    max_tokens: int = 12,
    timeout: float = 60.0,
    **extra: Any,
) -> ChatResult:
    """POST ``/v1/chat/completions`` (greedy); collect the text of a stream or a body."""
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": list(messages),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        **extra,
    }
    if conv is not None:
        body["conversation_id"] = conv
    with NodeClient(url, timeout=timeout) as client:
        reply = client.request("POST", CHAT_PATH, json=body, headers=headers)
    if not reply.ok:
        return ChatResult(reply.status, "", reply.content, reply.json() if reply.content else None)
    res = read_reply(reply, stream)
    return ChatResult(reply.status, res.text, reply.content, res.body)


def bidirectional_config(role: str, **extra: Any) -> KVTransferConfig:
    """``--kv-transfer-config`` of a bidirectional NixlConnector engine (vLLM's defaults)."""
    return kv_config(role, **extra)


def router_counter(url: str, name: str, **labels: str) -> float:
    """A ``bidir_kv_router_*_total`` counter scraped from a running router."""
    return scrape(url).value(f"bidir_kv_router_{name}_total", **labels)


def conversation_id(tag: str) -> str:
    """A conversation id unique within the test session."""
    return f"{tag}-{next(_conversations)}"


def long_opening(tag: str) -> list[dict[str, Any]]:
    """A first user turn long enough (well over 64 tokens) to make pulls worthwhile."""
    text = f"Conversation {tag}: tell me a long story about dragons, castles and rivers. " * 4
    return [{"role": "user", "content": text}]


@contextlib.contextmanager
def emulated_router_topology(
    config: pytest.Config,
    run_dir: Path,
    *,
    num_decode: int = 1,
    prefix_caching_on_p: bool = True,
    engine_args: tuple[str, ...] = (),
) -> Iterator[Any]:
    """Emulated P and D engines (TCP transport) behind one router, as processes.

    The router checks health every 0.5 s so a test sees a node's state change quickly.
    Skips (or fails under a required tier) where the emulated engine cannot be imported.
    """
    try:
        import bidir_kv.engine.cli  # noqa: F401
        from bidir_kv.topology.local import LocalTopology
    except ImportError as exc:
        skip_or_fail(config, "integration", f"emulated engine unavailable: {exc}")
    spec = TopologySpec(
        num_decode=num_decode,
        prefill=EngineSpec(
            kv=kv_config("prefill"),
            transport="tcp",
            enable_prefix_caching=prefix_caching_on_p,
            extra_args=engine_args,
        ),
        decode=EngineSpec(kv=kv_config("decode"), transport="tcp", extra_args=engine_args),
        router=RouterSpec(extra_args=("--health-interval", "0.5")),
    )
    with LocalTopology(spec, run_dir) as topology:
        yield topology
