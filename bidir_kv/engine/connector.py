"""Worker side of the emulated NixlConnector: peers, claims, READs, notifications.

The reader and the owner (``reader.py``, ``owner.py``) decide *what* to move; this
module moves it through a :class:`~bidir_kv.engine.transport.base.KVAgent` and the
side channel, applies transfer faults and pads durations to the cost profile. It
never makes a protocol decision.

Claims (our addition, docs/engine.md): before a READ the reader asks the owner,
over the owner's HTTP port, to claim the handle ``remote_request_id`` for the
blocks it will read. The owner grants a claim once, and only while it still holds
those blocks, so a second read of a released or already-read handle fails instead
of silently returning reused blocks (docs/protocol.md §15.5). The owner's HTTP port
travels in an envelope around the agent metadata of the side-channel handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from bidir_kv.engine import notifications
from bidir_kv.engine.faults import Faults
from bidir_kv.engine.fencewords import FenceTable
from bidir_kv.engine.transport.base import (
    KVAgent,
    KVTransportError,
    NotificationHandler,
    ReadResult,
)
from bidir_kv.engine.transport.sidechannel import (
    EngineMetadata,
    PeerInfo,
    SideChannelServer,
    handshake,
)
from bidir_kv.wire.ids import EngineId, RequestId
from bidir_kv.wire.params import HeldTokens

__all__ = ["ClaimRefused", "ConnectorWorker", "Peer", "StaleParams"]

logger = logging.getLogger("bidir_kv.engine")
_ENVELOPE = "bidir-kv-engine/1"
# vLLM's side-channel receive timeout is 5 s; ours is longer so a heavily loaded test
# machine does not turn scheduling delays into failed transfers
CONTROL_TIMEOUT = 30.0


class ClaimRefused(KVTransportError):
    """The owner answered and refused the claim: the peer itself is fine."""


class StaleParams(KVTransportError):
    """The params name an earlier start of the peer: their blocks died with it."""


PeerKey = tuple[str, int | str]


@dataclass
class Peer:
    """A handshaken remote engine."""

    info: PeerInfo
    agent_name: str
    http_port: int

    @property
    def engine_id(self) -> EngineId:
        return self.info.engine_id

    @property
    def offset(self) -> float:
        return self.info.offset


class ConnectorWorker:
    """KV movement for one engine."""

    def __init__(
        self,
        *,
        engine_id: EngineId,
        agent: KVAgent,
        side_host: str,
        side_port: int,
        block_size: int,
        compat_hash: str,
        enforce_compat: bool,
        faults: Faults,
        clock: Callable[[], float] = time.perf_counter,
        transfer_floor: Callable[[int], float] | None = None,
        tp_size: int = 1,
        fence: FenceTable | None = None,
    ) -> None:
        self.engine_id = engine_id
        # D's fence words (docs/connector.md §5); None: this engine does not speak the
        # fence (configured off, vLLM mode, or its words could not be registered)
        self.fence = fence
        self.agent = agent
        self.side_host = side_host
        self.side_port = side_port
        self.block_size = block_size
        self.compat_hash = compat_hash
        self.enforce_compat = enforce_compat
        self.faults = faults
        self.clock = clock
        self.transfer_floor = transfer_floor
        # emulated ranks; the agent's pool rows are per-rank shares (KVPool.rank_rows)
        self.tp_size = tp_size
        self.http_port = 0
        self._side: SideChannelServer | None = None
        # grows on each start (ms since the epoch): exported as
        # remote_registration_generation and in the handshake, so a peer that cached
        # us learns we restarted (docs/engine.md "Operations")
        self.generation = time.time_ns() // 1_000_000
        self._peers: dict[PeerKey, Peer] = {}
        self._locks: dict[PeerKey, asyncio.Lock] = {}
        self._session: Any = None  # aiohttp.ClientSession, created lazily

    # ---- lifecycle -----------------------------------------------------------------

    async def start(self, on_notification: NotificationHandler, http_port: int) -> None:
        self.http_port = http_port
        await self.agent.start(on_notification)
        if self.fence is not None and not self.agent.fence_registered:
            self.fence = None  # the transport said why, once; stock behaviour from here
        self._side = SideChannelServer(
            self.side_host, self.side_port, self.local_metadata, clock=self.clock
        )
        await self._side.start()
        self.side_port = self._side.port

    async def close(self) -> None:
        if self._side is not None:
            await self._side.close()
            self._side = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        await self.agent.close()

    def local_metadata(self) -> EngineMetadata:
        env: dict[str, Any] = {
            "envelope": _ENVELOPE,
            "agent": self.agent.metadata(),
            "http_port": self.http_port,
        }
        if self.tp_size != 1:  # absent means 1: a TP 1 handshake is unchanged
            env["tp_size"] = self.tp_size
        envelope = msgpack.packb(env, use_bin_type=True)
        return EngineMetadata(
            engine_id=self.engine_id,
            compat_hash=self.compat_hash,
            backend=self.agent.backend,
            agent_metadata=envelope,
            block_size=self.block_size,
            block_nbytes=self.agent.pool.block_nbytes,
            num_blocks=self.agent.pool.num_blocks,
            registration_generation=self.generation,
        )

    # ---- peers ---------------------------------------------------------------------

    async def peer(
        self,
        host: str,
        port: int,
        engine_id: EngineId | None,
        *,
        generation: int | None = None,
        by_engine_id: bool = False,
    ) -> Peer:
        """The handshaken peer at ``host:port``, handshaking when needed.

        Safe (default): cached per address; handshake again when the engine id
        changed or ``generation`` (the params' ``remote_registration_generation``)
        is newer than the cached one, and refuse params older than the live
        engine's (:class:`StaleParams`). ``by_engine_id`` reproduces vLLM 0.32:
        cached per engine id, never handshaken again while cached.
        """
        key: PeerKey = ("engine", engine_id) if by_engine_id and engine_id else (host, port)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            known = self._peers.get(key)
            if known is not None and (engine_id is None or known.engine_id == engine_id):
                if by_engine_id or generation is None:
                    return known
                if generation <= known.info.meta.registration_generation:
                    self._check_generation(known, generation)
                    return known
                logger.info(
                    "Engine %s at %s:%d restarted or re-registered (generation %d -> %d); "
                    "handshaking again",
                    known.engine_id,
                    host,
                    port,
                    known.info.meta.registration_generation,
                    generation,
                )
            peer = await self._handshake(host, port, engine_id)
            self._peers[key] = peer
        if not by_engine_id and generation is not None:
            self._check_generation(peer, generation)
        return peer

    @staticmethod
    def _check_generation(peer: Peer, generation: int) -> None:
        live = peer.info.meta.registration_generation
        if generation < live:
            raise StaleParams(
                f"kv_transfer_params name generation {generation} of engine {peer.engine_id}, "
                f"which restarted since (now generation {live}); its blocks are gone"
            )

    def forget(self, peer: Peer) -> None:
        """Drop a cached peer after a failure that suggests it went away."""
        for key, cached in list(self._peers.items()):
            if cached is peer:
                del self._peers[key]
                logger.info(
                    "Dropping cached peer %s; the next request handshakes again", peer.engine_id
                )

    def drop_engine(self, engine_id: EngineId) -> int:
        """Forget every cached handshake with ``engine_id`` (``POST /drop_peer``); how many."""
        keys = [key for key, peer in self._peers.items() if peer.engine_id == engine_id]
        for key in keys:
            del self._peers[key]
        if keys:
            logger.info("Dropped peer %s on request; the next request handshakes again", engine_id)
        return len(keys)

    async def _handshake(self, host: str, port: int, engine_id: EngineId | None) -> Peer:
        info = await handshake(
            host,
            port,
            local_hash=self.compat_hash,
            enforce_compat=self.enforce_compat,
            expected_engine_id=engine_id,
            backend=self.agent.backend,
            clock=self.clock,
            timeout=CONTROL_TIMEOUT,
        )
        if info.meta.block_size != self.block_size:
            raise KVTransportError(
                f"engine {info.engine_id} uses block size {info.meta.block_size}, "
                f"we use {self.block_size}"
            )
        try:
            env = msgpack.unpackb(info.meta.agent_metadata, raw=False)
        except (ValueError, msgpack.UnpackException) as exc:
            raise KVTransportError(f"peer metadata envelope is malformed: {exc}") from None
        if not isinstance(env, dict) or env.get("envelope") != _ENVELOPE:
            raise KVTransportError(
                f"engine {info.engine_id} is not a bidir-kv engine (no metadata envelope)"
            )
        remote_tp = int(env.get("tp_size", 1))
        if remote_tp != self.tp_size:
            raise KVTransportError(
                f"engine {info.engine_id} runs tensor_parallel_size {remote_tp}, we run "
                f"{self.tp_size}; the emulator needs equal TP on both sides"
            )
        name = await self.agent.add_peer(env["agent"])
        return Peer(info=info, agent_name=name, http_port=int(env["http_port"]))

    # ---- claims --------------------------------------------------------------------

    async def claim(
        self, peer: Peer, request_id: RequestId, blocks: Sequence[int]
    ) -> HeldTokens | None:
        """Ask the owner for single-use access to ``blocks`` of ``request_id``; returns
        what the handle holds (hashes of its tokens) when the owner says."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT)
            )
        host = peer.info.host
        url = f"http://{host}:{peer.http_port}/_emulator/claim"
        body = {"request_id": request_id, "blocks": list(blocks), "reader": self.engine_id}
        try:
            async with self._session.post(url, json=body) as resp:
                answer = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise KVTransportError(f"claim of {request_id} at {url} failed: {exc}") from None
        if resp.status != 200:
            reason = answer.get("error") if isinstance(answer, dict) else answer
            raise ClaimRefused(f"engine {peer.engine_id} refused to serve {request_id}: {reason}")
        held = answer.get("tokens") if isinstance(answer, dict) else None
        if held is None:
            return None
        try:
            return HeldTokens.from_wire(held)
        except ValueError as exc:
            raise KVTransportError(str(exc)) from None

    # ---- transfers -----------------------------------------------------------------

    async def read(
        self,
        peer: Peer,
        local: Sequence[int],
        remote: Sequence[int],
        notification: str,
        tokens: int,
        floor: float | None = None,
    ) -> ReadResult:
        """One READ with faults applied and the duration padded to the profile
        (``floor`` seconds when given, else the profile's wire time for ``tokens``)."""
        start = time.perf_counter()
        if self.faults.roll(self.faults.fail_transfers):
            raise KVTransportError("injected transfer failure (fault fail_transfers)")
        if self.faults.roll(self.faults.delay_transfers) and self.faults.delay_seconds > 0:
            await asyncio.sleep(self.faults.delay_seconds)
        local_rows, remote_rows = self.rank_rows(local), self.rank_rows(remote)
        res = await self.agent.read(peer.agent_name, local_rows, remote_rows, notification.encode())
        if floor is None and self.transfer_floor is not None:
            floor = self.transfer_floor(tokens)
        if floor is not None:
            elapsed = time.perf_counter() - start
            if floor > elapsed:
                await asyncio.sleep(floor - elapsed)
                res = ReadResult(res.bytes, res.descriptors, res.post_time, floor)
        return res

    def rank_rows(self, blocks: Sequence[int]) -> Sequence[int]:
        """The agent's rows for ``blocks``: every rank's share of each block, block-major.

        One READ carries all ranks' descriptor sets (``tp_size`` per block), so the
        bytes equal a TP 1 read; metrics split it per rank (EngineMetrics.read_done)."""
        n = self.tp_size
        if n == 1:
            return blocks
        return [b * n + r for b in blocks for r in range(n)]

    def can_check_fence(self, peer: Peer) -> bool:
        """Whether we speak the fence and ``peer`` published fence words."""
        return self.fence is not None and self.agent.peer_has_fence(peer.agent_name)

    async def read_fence_word(self, peer: Peer, slot: int) -> int:
        """One READ of ``peer``'s fence word ``slot`` (after a block READ completed)."""
        return await self.agent.read_word(peer.agent_name, slot)

    async def notify(self, peer: Peer, message: str) -> None:
        await self.agent.notify(peer.agent_name, message.encode())

    async def heartbeat_loop(
        self, peer: Peer, request_ids: Sequence[RequestId], interval: float
    ) -> None:
        """Send ``HB:<ids>`` every ``interval`` s until cancelled (D keeping P's lease)."""
        msg = notifications.heartbeat(request_ids)
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(KVTransportError):
                await self.notify(peer, msg)
