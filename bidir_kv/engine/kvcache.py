"""Block manager over the engine's :class:`KVPool`, with a prefix cache.

Mirrors vLLM's KV cache manager in the parts the protocol depends on: block 0 is
a reserved null block (so exported block ids start at 1, as on real engines),
blocks are reference counted, a freed block keeps its cached hash and stays
hittable until it is reused (LRU eviction), and the cache is keyed by the
block-hash chain of :func:`bidir_kv.policy.block_hashes`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from bidir_kv.engine.model import fingerprints
from bidir_kv.engine.transport.base import KVPool
from bidir_kv.errors import EngineError

__all__ = ["BlockManager", "NoFreeBlocks"]


class NoFreeBlocks(EngineError, RuntimeError):
    """Not enough free or evictable blocks right now."""


class BlockManager:
    """Allocation, reference counts and the prefix cache of one engine."""

    def __init__(
        self, pool: KVPool, block_size: int, num_layers: int, enable_prefix_caching: bool = True
    ) -> None:
        if pool.block_nbytes % (block_size * num_layers):
            raise ValueError(
                f"block of {pool.block_nbytes} bytes does not split into {num_layers} layers x "
                f"{block_size} slots"
            )
        self.pool = pool
        self.block_size = block_size
        self.num_layers = num_layers
        self.bytes_per_layer_slot = pool.block_nbytes // (block_size * num_layers)
        self.enable_prefix_caching = enable_prefix_caching
        # (block, layer, slot, byte) view of the same memory
        self.view = pool.data.reshape(
            pool.num_blocks, num_layers, block_size, self.bytes_per_layer_slot
        )
        self._ref = [0] * pool.num_blocks
        self._free: OrderedDict[int, None] = OrderedDict(
            (b, None) for b in range(1, pool.num_blocks)
        )
        self._hash_of: dict[int, bytes] = {}
        self._cached: dict[bytes, int] = {}

    # ---- capacity ------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1  # block 0 is the null block

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_usable_blocks

    # ---- prefix cache --------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` (no reference taken)."""
        if not self.enable_prefix_caching:
            return []
        out = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register a full block under its chain hash (first writer wins)."""
        if not self.enable_prefix_caching or block in self._hash_of:
            return
        if block_hash in self._cached:
            return
        self._hash_of[block] = block_hash
        self._cached[block_hash] = block

    # ---- references ----------------------------------------------------------

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on (possibly evictable) cached blocks."""
        for b in blocks:
            if self._ref[b] == 0:
                self._free.pop(b, None)
            self._ref[b] += 1

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh blocks; evicts least recently freed cached blocks if needed."""
        if count > len(self._free):
            raise NoFreeBlocks(f"need {count} blocks, {len(self._free)} free or evictable")
        out = []
        for _ in range(count):
            b, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(b, None)
            if h is not None and self._cached.get(h) == b:
                del self._cached[h]
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference each; unreferenced blocks become free (cached ones evictable).

        Uncached blocks go to the front of the queue (reused first), cached ones to
        the back, so the prefix cache keeps recently used history longest.
        """
        # reversed: front insertion then leaves the first block first in line for reuse
        for b in reversed(list(blocks)):
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than referenced")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if b not in self._hash_of:
                    self._free.move_to_end(b, last=False)

    def reuse_free(self, blocks: Iterable[int]) -> int:
        """What a new owner does to free ``blocks``: drop their cached hash and write
        new bytes (fault injection: a released turn reused during a read). Blocks
        still referenced are left alone; returns how many were rewritten."""
        done = 0
        for b in blocks:
            if self._ref[b]:
                continue
            h = self._hash_of.pop(b, None)
            if h is not None and self._cached.get(h) == b:
                del self._cached[h]
            self.pool.data[b] ^= 0x5A
            done += 1
        return done

    # ---- contents ------------------------------------------------------------

    def write_slots(self, blocks: Sequence[int], start: int, content: np.ndarray) -> None:
        """Write ``content`` (shape ``(n, layers, bytes_per_layer_slot)``) to slots
        ``start..start+n``.

        ``blocks`` is the request's block table (position block ``i`` -> ``blocks[i]``).
        """
        bs = self.block_size
        n = content.shape[0]
        pos = start
        end = start + n
        # leading partial block
        while pos < end and (pos % bs or end - pos < bs):
            stop = min(end, (pos // bs + 1) * bs)
            b = blocks[pos // bs]
            self.view[b, :, pos % bs : pos % bs + (stop - pos), :] = content[
                pos - start : stop - start
            ].transpose(1, 0, 2)
            pos = stop
        if pos < end:
            full = (end - pos) // bs
            ids = np.asarray(blocks[pos // bs : pos // bs + full], dtype=np.int64)
            chunk = content[pos - start : pos - start + full * bs]
            self.view[ids] = chunk.reshape(
                full, bs, self.num_layers, self.bytes_per_layer_slot
            ).transpose(0, 2, 1, 3)
            pos += full * bs
            if pos < end:
                self.write_slots(blocks, pos, content[pos - start :])

    def read_slots(self, block: int, first: int, count: int) -> np.ndarray:
        """Slot bytes of one block as ``(count, layers, bytes_per_layer_slot)``."""
        return self.view[block, :, first : first + count, :].transpose(1, 0, 2)

    def block_bytes(self, block: int, valid_slots: int | None = None) -> bytes:
        """Bytes of the first ``valid_slots`` slots (all layers) of ``block``."""
        if valid_slots is None or valid_slots >= self.block_size:
            return self.pool.data[block].tobytes()
        return np.ascontiguousarray(self.view[block, :, :valid_slots, :]).tobytes()

    def fingerprints(self, blocks: Sequence[int]) -> np.ndarray:
        """``model.fingerprints`` of whole blocks, one uint64 each, in ``blocks`` order.

        Runs of consecutive ids (the usual block table) are read in place; a
        scattered table is gathered into one copy first."""
        ids = np.asarray(blocks, dtype=np.intp)
        cuts = (np.flatnonzero(np.diff(ids) != 1) + 1).tolist()
        if len(cuts) * 16 > len(ids):
            return fingerprints(self.pool.data[ids])
        bounds = zip([0, *cuts], [*cuts, len(ids)], strict=True)
        data = self.pool.data
        parts = [fingerprints(data[ids[a] : ids[a] + b - a]) for a, b in bounds]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)

    def tail_fingerprint(self, block: int, valid_slots: int) -> int:
        """``model.fingerprints`` of the first ``valid_slots`` slots (all layers) of ``block``."""
        rows = np.ascontiguousarray(self.view[block, :, :valid_slots, :]).reshape(1, -1)
        return int(fingerprints(rows)[0])
