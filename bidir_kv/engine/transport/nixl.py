"""The NIXL transport: the engine's pool registered as DRAM with NIXL's UCX backend.

What vLLM's NixlConnector does on the CPU platform, reduced to one region: the pool
is registered once, each block is one prepared descriptor, and a READ of block ids is
a prepared transfer from the peer's descriptor list into ours with the notification
attached, so the owner learns of completion from NIXL itself. Transfers and
notification polls run on the engine's event loop and never block it: the state is
polled with yields in between. ``nixl`` is imported only here, and only on first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bidir_kv.engine.transport import wire
from bidir_kv.engine.transport.base import (
    KVAgent,
    KVPool,
    KVTransportError,
    NotificationHandler,
    ReadResult,
)
from bidir_kv.engine.transport.dispatch import NotificationDispatcher
from bidir_kv.engine.transport.framing import decode_agent_metadata, encode_agent_metadata

__all__ = ["NixlAgent", "nixl_api", "probe"]

logger = logging.getLogger("bidir_kv.engine.transport")

_MEM = "DRAM"  # NIXL's memory type for host memory


def nixl_api() -> Any:
    """NIXL's Python API, imported on first use (it brings up UCX's libraries)."""
    # vLLM sets this whenever NIXL is available; UCX reads it at context creation.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    import nixl._api as api

    return api


def _ucx_tls_hint() -> str:
    tls = os.environ.get("UCX_TLS")
    if tls and "tcp" not in tls.split(",") and "all" not in tls:
        return f" (UCX_TLS={tls} has no tcp: UCX then lacks an active-message transport)"
    return ""


def _prog_thread_default() -> bool:
    return os.environ.get("BIDIR_KV_NIXL_PROG_THREAD", "0").lower() in ("1", "true", "yes")


def _new_agent(name: str, backends: Sequence[str], prog_thread: bool | None = None) -> Any:
    try:
        api = nixl_api()
    except ImportError as exc:
        raise KVTransportError(f"nixl does not import: {exc}") from None
    conf = api.nixl_agent_config(
        enable_prog_thread=_prog_thread_default() if prog_thread is None else prog_thread,
        backends=list(backends),
        capture_telemetry=True,
    )
    agent = api.nixl_agent(name, conf)
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise KVTransportError(f"NIXL backend(s) {missing} did not start{_ucx_tls_hint()}")
    return agent


def probe() -> tuple[bool, str]:
    """Can a UCX-backed NIXL agent be created in this process? ``(ok, reason)``."""
    try:
        nixl_api()
    except Exception as exc:
        return False, f"nixl does not import: {exc}"
    try:
        agent = _new_agent(f"bidir-kv-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}", ["UCX"])
    except Exception as exc:
        return False, f"NIXL agent with UCX failed: {exc}{_ucx_tls_hint()}"
    del agent
    from importlib.metadata import PackageNotFoundError, version

    try:
        return True, f"nixl {version('nixl')}"
    except PackageNotFoundError:
        return True, "nixl"


def _block_descs(base: int, num_blocks: int, block_nbytes: int) -> np.ndarray:
    """One ``(addr, len, devid)`` row per block: block ``i`` is descriptor ``i``."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_nbytes)
    descs[:, 1] = block_nbytes
    descs[:, 2] = 0
    return descs


def _ids(blocks: Sequence[int], num_blocks: int, what: str) -> np.ndarray:
    arr = np.asarray(list(blocks), dtype=np.int64)
    if arr.ndim != 1:
        raise KVTransportError(f"{what} block ids must be a flat list")
    bad = arr[(arr < 0) | (arr >= num_blocks)]
    if bad.size:
        raise KVTransportError(
            f"{what} block id {int(bad[0])} out of range for a pool of {num_blocks} blocks"
        )
    return arr.astype(np.int32)


def _word_descs(base: int, slots: int) -> np.ndarray:
    """One 8-byte descriptor per fence word: word ``i`` is descriptor ``i``."""
    descs = np.empty((slots, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(slots, dtype=np.uint64) * np.uint64(8)
    descs[:, 1] = 8
    descs[:, 2] = 0
    return descs


@dataclass
class _Peer:
    name: str
    num_blocks: int
    dlist: Any  # prepared remote descriptor list
    fence_slots: int = 0
    fence_dlist: Any = None  # prepared list of the peer's fence words


class NixlAgent(KVAgent):
    """READs over NIXL/UCX with notifications, one DRAM registration per pool."""

    backend = wire.NIXL

    def __init__(
        self,
        name: str,
        pool: KVPool,
        *,
        backends: Sequence[str] = ("UCX",),
        notif_poll_interval: float = 0.001,
        notif_poll_idle: float = 0.001,
        io_timeout: float = 60.0,
    ) -> None:
        super().__init__(name, pool)
        if not pool.data.flags["C_CONTIGUOUS"]:
            raise KVTransportError("the KV pool must be C-contiguous to register with NIXL")
        self.backends = tuple(backends)
        self.notif_poll_interval = notif_poll_interval
        self.notif_poll_idle = max(notif_poll_idle, notif_poll_interval)
        self.io_timeout = io_timeout
        # Created here, not in start(), so create_agent("auto") learns at once whether
        # NIXL works in this process and can fall back to TCP without a second agent.
        try:
            self._nixl: Any = _new_agent(name, self.backends)
        except KVTransportError:
            raise
        except Exception as exc:
            raise KVTransportError(f"NIXL agent {name} failed: {exc}{_ucx_tls_hint()}") from None
        self._agent: Any = None
        self._reg: Any = None
        self._local: Any = None
        self._peers: dict[str, _Peer] = {}
        self._dispatch: NotificationDispatcher | None = None
        self._poller: asyncio.Task[None] | None = None
        # fence words (ours, registered when attached) and the one word we READ into
        self._scratch = np.zeros(1, dtype=np.uint64)
        self._fence_reg: Any = None
        self._scratch_local: Any = None
        self._word_lock = asyncio.Lock()

    async def start(self, on_notification: NotificationHandler) -> None:
        if self._agent is not None:
            raise KVTransportError(f"agent {self.name} already started")
        agent = self._nixl
        if agent is None:
            raise KVTransportError(f"agent {self.name} was closed; create a new one")
        try:
            region = np.array(
                [[self.pool.data.ctypes.data, self.pool.data.nbytes, 0]], dtype=np.uint64
            )
            self._reg = agent.register_memory(region, _MEM)
            self._local = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT",
                _block_descs(
                    self.pool.data.ctypes.data, self.pool.num_blocks, self.pool.block_nbytes
                ),
                _MEM,
            )
        except KVTransportError:
            raise
        except Exception as exc:
            raise KVTransportError(f"NIXL agent {self.name} failed to start: {exc}") from None
        self._agent = agent
        self._register_fence(agent)
        self._dispatch = NotificationDispatcher(on_notification)
        self._dispatch.start()
        self._poller = asyncio.get_running_loop().create_task(self._poll_notifs())

    def _register_fence(self, agent: Any) -> None:
        """Our fence words and the scratch word, as a second DRAM registration. A
        failure is one log line and a start without the fence (stock behaviour)."""
        words = self.fence
        regions = [[self._scratch.ctypes.data, self._scratch.nbytes, 0]]
        if words is not None:
            regions.append([words.ctypes.data, words.nbytes, 0])
        try:
            self._fence_reg = agent.register_memory(np.array(regions, dtype=np.uint64), _MEM)
            self._scratch_local = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", _word_descs(self._scratch.ctypes.data, 1), _MEM
            )
        except Exception as exc:
            logger.warning(
                "NIXL agent %s: fence words could not be registered (%s); "
                "running without the fence (stock behaviour)",
                self.name,
                exc,
            )
            self._fence_reg = self._scratch_local = None
            return
        self.fence_registered = words is not None

    def _live(self) -> Any:
        if self._agent is None:
            raise KVTransportError(f"agent {self.name} is not started")
        return self._agent

    def metadata(self) -> bytes:
        agent = self._live()
        fields: dict[str, Any] = {
            "name": self.name,
            "agent_md": agent.get_agent_metadata(),
            "base": int(self.pool.data.ctypes.data),
            "num_blocks": self.pool.num_blocks,
            "block_nbytes": self.pool.block_nbytes,
        }
        if self.fence_registered and self.fence is not None:
            fields[wire.FENCE_BASE] = int(self.fence.ctypes.data)
            fields[wire.FENCE_SLOTS] = int(self.fence.shape[0])
        return encode_agent_metadata(wire.NIXL, fields)

    async def add_peer(self, metadata: bytes) -> str:
        agent = self._live()
        md = decode_agent_metadata(metadata, wire.NIXL, wire.NIXL_METADATA, self.pool.block_nbytes)
        self._drop_peer(md["name"])  # re-registration (new generation): start afresh
        try:
            raw_name = agent.add_remote_agent(md["agent_md"])
            name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
            dlist = agent.prep_xfer_dlist(
                name, _block_descs(md["base"], md["num_blocks"], md["block_nbytes"]), _MEM
            )
        except Exception as exc:
            raise KVTransportError(f"cannot add NIXL peer {md.get('name')}: {exc}") from None
        if name != md["name"]:
            raise KVTransportError(f"NIXL metadata names {name!r}, wrapper says {md['name']!r}")
        with contextlib.suppress(Exception):  # optional: warms the connection up front
            agent.make_connection(name)
        peer = _Peer(name, int(md["num_blocks"]), dlist)
        base, slots = md.get(wire.FENCE_BASE), md.get(wire.FENCE_SLOTS)
        if isinstance(base, int) and isinstance(slots, int) and slots > 0 and self._scratch_local:
            try:
                peer.fence_dlist = agent.prep_xfer_dlist(name, _word_descs(base, slots), _MEM)
                peer.fence_slots = slots
            except Exception as exc:
                logger.warning(
                    "NIXL peer %s: its fence words cannot be prepared (%s); its reads go unfenced",
                    name,
                    exc,
                )
        self._peers[name] = peer
        return name

    def _drop_peer(self, name: str) -> None:
        peer = self._peers.pop(name, None)
        if peer is None or self._agent is None:
            return
        with contextlib.suppress(Exception):
            self._agent.release_dlist_handle(peer.dlist)
        if peer.fence_dlist is not None:
            with contextlib.suppress(Exception):
                self._agent.release_dlist_handle(peer.fence_dlist)
        with contextlib.suppress(Exception):
            self._agent.remove_remote_agent(name)

    def _peer(self, name: str) -> _Peer:
        try:
            return self._peers[name]
        except KeyError:
            raise KVTransportError(f"unknown peer {name!r}; add_peer() it first") from None

    async def read(
        self,
        peer: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        notification: bytes,
    ) -> ReadResult:
        agent = self._live()
        p = self._peer(peer)
        if len(local_blocks) != len(remote_blocks):
            raise KVTransportError(
                f"read pairs {len(local_blocks)} local with {len(remote_blocks)} remote blocks"
            )
        local = _ids(local_blocks, self.pool.num_blocks, "local")
        remote = _ids(remote_blocks, p.num_blocks, "requested")
        if local.size == 0:
            await self.notify(peer, notification)
            return ReadResult(bytes=0, descriptors=0, post_time=0.0, xfer_time=0.0)
        try:
            handle = agent.make_prepped_xfer(
                "READ", self._local, local, p.dlist, remote, bytes(notification)
            )
        except Exception as exc:
            raise KVTransportError(f"cannot prepare READ from {peer}: {exc}") from None
        try:
            return await self._run(agent, handle, peer, int(local.size))
        finally:
            with contextlib.suppress(Exception):
                agent.release_xfer_handle(handle)

    async def _run(self, agent: Any, handle: Any, peer: str, nblocks: int) -> ReadResult:
        t0 = time.perf_counter()
        try:
            state = agent.transfer(handle)
        except Exception as exc:
            raise KVTransportError(f"posting READ from {peer} failed: {exc}") from None
        post = time.perf_counter() - t0
        try:
            state = await self._wait(agent, handle, peer, state, t0 + self.io_timeout)
        except asyncio.CancelledError:
            # The engine will hand these local blocks to someone else next: let the
            # READ finish (or fail) first so no bytes land in them afterwards.
            with contextlib.suppress(Exception):
                await self._wait(agent, handle, peer, "PROC", time.perf_counter() + 5.0)
            raise
        xfer = time.perf_counter() - t0
        if state != "DONE":
            raise KVTransportError(f"READ from {peer} ended in state {state}")
        nbytes = nblocks * self.pool.block_nbytes
        descriptors = nblocks
        with contextlib.suppress(Exception):
            tel = agent.get_xfer_telemetry(handle)
            descriptors = int(tel.descCount) or nblocks
        return ReadResult(bytes=nbytes, descriptors=descriptors, post_time=post, xfer_time=xfer)

    @staticmethod
    async def _wait(agent: Any, handle: Any, peer: str, state: str, deadline: float) -> str:
        """Poll a posted READ until it leaves ``PROC``, yielding to the event loop."""
        polls = 0
        while state == "PROC":
            # Yield at once for the first polls (small reads finish in microseconds),
            # then back off to at most 0.5 ms so a long READ does not spin a core.
            await asyncio.sleep(0 if polls < 20 else min(0.0005, 0.00002 * polls))
            polls += 1
            try:
                state = agent.check_xfer_state(handle)
            except Exception as exc:
                raise KVTransportError(f"READ from {peer} failed: {exc}") from None
            if state == "PROC" and time.perf_counter() > deadline:
                raise KVTransportError(f"READ from {peer} did not complete before its deadline")
        return str(state)

    def peer_has_fence(self, peer: str) -> bool:
        p = self._peers.get(peer)
        return p is not None and p.fence_slots > 0

    async def read_word(self, peer: str, slot: int) -> int:
        agent = self._live()
        p = self._peer(peer)
        if not 0 <= slot < p.fence_slots:
            raise KVTransportError(f"peer {peer} has no fence word {slot}")
        async with self._word_lock:  # one scratch word: word reads take turns
            try:
                handle = agent.make_prepped_xfer(
                    "READ", self._scratch_local, [0], p.fence_dlist, [int(slot)], b""
                )
            except Exception as exc:
                raise KVTransportError(f"cannot prepare fence READ from {peer}: {exc}") from None
            try:
                await self._run(agent, handle, peer, 0)
            finally:
                with contextlib.suppress(Exception):
                    agent.release_xfer_handle(handle)
            return int(self._scratch[0])

    async def notify(self, peer: str, message: bytes) -> None:
        agent = self._live()
        self._peer(peer)
        try:
            agent.send_notif(peer, bytes(message))
        except Exception as exc:
            raise KVTransportError(f"notification to {peer} failed: {exc}") from None

    async def _poll_notifs(self) -> None:
        """Poll NIXL for notifications; this also drives UCX progress on the owner side.

        Without a progress thread, a peer's READ from us completes only after we call
        into NIXL (measured: a READ stays PROC while the owner does not poll, even
        with all bytes copied), so the poll period bounds every read's latency. Every
        ``notif_poll_interval`` s while messages arrive, backing off to
        ``notif_poll_idle`` s when idle (both 1 ms by default: a 1 MiB read after an
        idle pause took ~2 ms median with 1 ms, ~8 ms with a 10 ms backoff; an idle
        agent costs a few % of a core).
        """
        interval = self.notif_poll_interval
        while True:
            agent = self._agent
            dispatch = self._dispatch
            if agent is None or dispatch is None:
                return
            try:
                notifs = agent.get_new_notifs()
            except Exception:
                logger.exception("NIXL agent %s: polling notifications failed", self.name)
                notifs = {}
            for peer, messages in notifs.items():
                name = peer.decode() if isinstance(peer, bytes) else str(peer)
                for m in messages:
                    dispatch.put(name, bytes(m))
            if notifs:
                interval = self.notif_poll_interval
            else:
                interval = min(self.notif_poll_idle, interval * 1.5)
            await asyncio.sleep(interval)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        agent = self._agent
        if agent is not None:
            for name in list(self._peers):
                self._drop_peer(name)
            with contextlib.suppress(Exception):
                agent.release_dlist_handle(self._local)
            if self._scratch_local is not None:
                with contextlib.suppress(Exception):
                    agent.release_dlist_handle(self._scratch_local)
            if self._fence_reg is not None:
                with contextlib.suppress(Exception):
                    agent.deregister_memory(self._fence_reg)
            with contextlib.suppress(Exception):
                agent.deregister_memory(self._reg)
            self._agent = None
        self._nixl = None
        if self._dispatch is not None:
            await self._dispatch.close()
            self._dispatch = None
