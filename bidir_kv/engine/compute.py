"""The emulated forward pass: write KV for token slots, cache full blocks, sample.

KV bytes are a pure function of the token prefix (``model.KVContent``) and the next
token is a digest of the bytes actually in the pool, so a wrong or stale pull shows
up in the output. Shared by the step loop (compute, sample) and the reader
(registering pulled blocks, verifying them).
"""

from __future__ import annotations

import numpy as np

from bidir_kv.engine.groups import GroupTables
from bidir_kv.engine.kvcache import BlockManager
from bidir_kv.engine.model import KVContent, next_token
from bidir_kv.engine.request import Request
from bidir_kv.policy import block_hashes

__all__ = ["ModelRunner"]


class ModelRunner:
    """KV writes and sampling over one engine's block manager."""

    def __init__(self, blocks: BlockManager, groups: GroupTables | None = None) -> None:
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.content = KVContent(blocks.num_layers, blocks.bytes_per_layer_slot)
        self.groups = groups  # the other KV cache groups (None: one full-attention group)

    def slot_hashes(self, req: Request, start: int, end: int) -> np.ndarray:
        """Token-prefix hashes of slots ``[start, end)``."""
        if req.slot_hash_pos > start:
            req.reset_slot_hashes()
        if req.slot_hash_pos < start:
            pre = self.content.prefix_hashes(req.tokens[req.slot_hash_pos : start], req.slot_hash)
            req.slot_hash_pos, req.slot_hash = start, int(pre[-1])
        hashes = self.content.prefix_hashes(req.tokens[start:end], req.slot_hash)
        if len(hashes):
            req.slot_hash_pos, req.slot_hash = end, int(hashes[-1])
        return hashes

    def compute(self, req: Request, start: int, end: int) -> None:
        """Write KV for slots ``[start, end)`` and cache blocks that became full."""
        hashes = self.slot_hashes(req, start, end)
        self.blocks.write_slots(req.blocks, start, self.content.slots(hashes))
        if self.groups is not None:
            self.groups.write(self.content, req, start, hashes)
        req.num_computed = end
        self.cache_full_blocks(req)

    def cache_full_blocks(self, req: Request) -> None:
        """Register every full block up to ``num_computed`` in the prefix cache."""
        bs = self.block_size
        full = req.num_computed // bs
        if len(req.block_chain) < full:
            start = len(req.block_chain) * bs
            tokens = req.tokens[start : full * bs]
            more = (
                block_hashes(tokens, bs, req.block_chain[-1])
                if req.block_chain
                else block_hashes(tokens, bs, req.chain_root)
            )
            req.block_chain.extend(more)
        while req.num_cached_blocks < full:
            i = req.num_cached_blocks
            self.blocks.cache(req.blocks[i], req.block_chain[i])
            req.num_cached_blocks += 1

    def sample(self, req: Request) -> int:
        """Next token from the KV bytes of slots ``[0, num_computed)``.

        The digest streams one fingerprint per full block (``model.fingerprints``) in
        block-table order, then the partial last block's, so it is the same however
        the slots were reached (one prefill, chunks, a pull, decode steps)."""
        bs = self.block_size
        n = req.num_computed
        full = n // bs
        if req.num_digested_blocks > full:
            req.reset_kv_digest()
        if req.num_digested_blocks < full:
            blocks = req.blocks[req.num_digested_blocks : full]
            req.kv_digest.update(self.blocks.fingerprints(blocks).astype("<u8").tobytes())
            req.num_digested_blocks = full
        d = req.kv_digest.copy()
        tail = n - full * bs
        if tail:
            fp = self.blocks.tail_fingerprint(req.blocks[full], tail)
            d.update(tail.to_bytes(4, "little") + fp.to_bytes(8, "little"))
        if self.groups is not None:
            d.update(self.groups.window_digest(req, n))
        return next_token(d.digest(), req.tokens[n - 1], allow_eos=not req.ignore_eos)

    def mismatched_blocks(self, req: Request, start: int, end: int) -> int:
        """Blocks of slots ``[start, end)`` whose bytes differ from what the tokens imply."""
        bs = self.block_size
        hashes = self.slot_hashes(req, start, end)
        expected = self.content.slots(hashes)
        bad = 0
        for i, pos in enumerate(range(start, end, bs)):
            stop = min(end, pos + bs)
            got = self.blocks.read_slots(req.blocks[pos // bs], 0, stop - pos)
            if not np.array_equal(got, expected[i * bs : i * bs + (stop - pos)]):
                bad += 1
        if self.groups is not None:
            bad += self.groups.mismatched(self.content, req, hashes, start, end)
        return bad
