"""The transport contract between the engine (scheduler side) and the KV movers.

The engine owns one :class:`KVPool`: a contiguous ``uint8`` array of
``num_blocks x block_nbytes``; block ``i`` is row ``i``. An agent registers the
pool once, publishes opaque ``metadata()`` through the side channel, and lets a
peer READ rows of it. As in NIXL, the *reader* initiates (D->P readbacks are
posted by P) and the owner learns of completion only through the notification
attached to the read (``"<owner_request_id>:<n>"``).
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from bidir_kv.errors import KVTransferError

__all__ = ["KVAgent", "KVPool", "KVTransportError", "NotificationHandler", "ReadResult"]


class KVTransportError(KVTransferError, RuntimeError):
    """A handshake, read or notification failed; counted as a failed transfer."""


@dataclass
class KVPool:
    """The engine's KV memory: ``data[block_id]`` is one block's bytes (all layers)."""

    data: np.ndarray  # shape (num_blocks, block_nbytes), dtype uint8, C-contiguous

    @classmethod
    def allocate(cls, num_blocks: int, block_nbytes: int) -> KVPool:
        if num_blocks <= 0 or block_nbytes <= 0:
            raise ValueError(f"pool needs positive sizes, got {num_blocks} x {block_nbytes}")
        return cls(np.zeros((num_blocks, block_nbytes), dtype=np.uint8))

    def rank_rows(self, ranks: int) -> KVPool:
        """The same memory seen as ``ranks`` shares per block: row ``b * ranks + r`` is
        rank ``r``'s ``1/ranks`` of block ``b`` (emulated tensor parallelism)."""
        if ranks == 1:
            return self
        if self.block_nbytes % ranks:
            raise ValueError(
                f"block of {self.block_nbytes} bytes does not split into {ranks} ranks"
            )
        return KVPool(self.data.reshape(self.num_blocks * ranks, self.block_nbytes // ranks))

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[0])

    @property
    def block_nbytes(self) -> int:
        return int(self.data.shape[1])


@dataclass(frozen=True)
class ReadResult:
    """Telemetry of one completed READ, in vLLM's terms (``KV Transfer metrics``)."""

    bytes: int
    descriptors: int
    post_time: float  # seconds to post the transfer
    xfer_time: float  # seconds from post to completion


# (peer agent name, notification message) -> None; called on the engine's loop.
NotificationHandler = Callable[[str, bytes], Awaitable[None] | None]


class KVAgent(abc.ABC):
    """One engine's transport endpoint."""

    backend: str  # the transport this agent speaks: wire.TCP or wire.NIXL

    def __init__(self, name: str, pool: KVPool) -> None:
        self.name = name
        self.pool = pool
        # D's fence words (docs/connector.md §5), registered beside the pool by start()
        # when attached; ``fence_registered`` says whether peers can READ them.
        self.fence: np.ndarray | None = None
        self.fence_registered = False

    def attach_fence(self, words: np.ndarray) -> None:
        """Register ``words`` (``uint64``, C-contiguous) with the pool at :meth:`start`."""
        if words.dtype != np.uint64 or not words.flags["C_CONTIGUOUS"]:
            raise KVTransportError("fence words must be a C-contiguous uint64 array")
        self.fence = words

    def peer_has_fence(self, peer: str) -> bool:
        """Whether ``peer`` published fence words we can READ (its metadata says so)."""
        return False

    async def read_word(self, peer: str, slot: int) -> int:
        """READ one fence word of ``peer`` (no notification); :class:`KVTransportError`
        when the peer has none or the read fails."""
        raise KVTransportError(f"transport {self.backend} cannot read fence words")

    @abc.abstractmethod
    async def start(self, on_notification: NotificationHandler) -> None:
        """Register the pool and begin delivering notifications to ``on_notification``."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """Opaque blob a peer needs to read from this agent (served by the side channel)."""

    @abc.abstractmethod
    async def add_peer(self, metadata: bytes) -> str:
        """Register a peer from its ``metadata()``; return the peer's agent name."""

    @abc.abstractmethod
    async def read(
        self,
        peer: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        notification: bytes,
    ) -> ReadResult:
        """Copy ``remote_blocks`` of ``peer`` into ``local_blocks`` of our pool, in order,
        then deliver ``notification`` to the peer. Raises :class:`KVTransportError`."""

    @abc.abstractmethod
    async def notify(self, peer: str, message: bytes) -> None:
        """Deliver a notification without reading (notify-only, heartbeats)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Deregister memory, drop peers, stop background work; idempotent."""
