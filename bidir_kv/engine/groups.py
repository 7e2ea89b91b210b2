"""Several KV cache groups in one engine: vLLM's hybrid KV cache manager, emulated.

``--kv-cache-groups full,sliding_window:W`` gives the engine the layout of a hybrid
attention model (docs/engine.md "KV cache groups"): the model's layers split evenly
between the groups, every group has its own block table over the one block pool, and
each block holds the KV of its group's layers. As in vLLM
(``SlidingWindowManager``), a sliding-window group frees a block as soon as every token
in it left the window of the next token to compute, and puts the null block (0) in its
table instead; D exports every group's list and clips sliding ones to their last
``cdiv(W, bs) + 1`` entries (:mod:`bidir_kv.policy.groups`).

The first full-attention group's table is ``Request.blocks`` (the one a single-group
engine has); the others live in ``Request.group_blocks``, keyed by group index. KV bytes
of another group are the same pure function of the token prefix, salted with the group
(a block read into the wrong group, or at the wrong position, changes the answer), and
the next token digests the first full group whole plus each sliding group's window.
The prefix cache is not emulated with several groups (it is off; docs/engine.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bidir_kv.engine.kvcache import BlockManager
from bidir_kv.engine.model import KVContent
from bidir_kv.engine.request import Request
from bidir_kv.errors import EngineError
from bidir_kv.policy import (
    NULL_BLOCK,
    GroupKind,
    KVGroup,
    cdiv,
    exported_window_blocks,
    suffix_trim_pairing,
    trim_groups,
    window_block_range,
)

__all__ = ["GroupTables", "PairingRefused", "parse_groups"]

_GOLD = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


class PairingRefused(EngineError, ValueError):
    """D's groups cannot be read for this pull; ``reason`` is a policy refusal."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def parse_groups(spec: str, block_size: int) -> tuple[KVGroup, ...]:
    """``--kv-cache-groups``: comma-separated ``full`` or ``sliding_window:W`` (W tokens),
    in vLLM's group order; exactly one full-attention group. ``ValueError`` names the
    problem."""
    out: list[KVGroup] = []
    for raw in spec.split(","):
        item = raw.strip()
        kind, _, arg = item.partition(":")
        if kind == GroupKind.FULL and not arg:
            out.append(KVGroup.full(block_size))
        elif kind == GroupKind.SLIDING_WINDOW and arg.isdigit() and int(arg) > 0:
            out.append(KVGroup.sliding(int(arg), block_size))
        else:
            raise ValueError(
                f"--kv-cache-groups: {item!r} is not 'full' or 'sliding_window:W' "
                "(W a positive number of tokens)"
            )
    if sum(g.kind == GroupKind.FULL for g in out) != 1:
        raise ValueError(
            f"--kv-cache-groups {spec!r}: the emulator needs exactly one full-attention group"
        )
    return tuple(out)


@dataclass(frozen=True)
class _Other:
    index: int  # the group's position in remote_block_ids
    group: KVGroup
    salt: int


class GroupTables:
    """Block tables, KV writes, window release, digest and pairing of every group."""

    def __init__(self, layout: Sequence[KVGroup], blocks: BlockManager) -> None:
        self.layout = tuple(layout)
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.primary = next(i for i, g in enumerate(self.layout) if g.kind == GroupKind.FULL)
        self.others = [
            _Other(i, g, ((i + 1) * _GOLD) & _M64)
            for i, g in enumerate(self.layout)
            if i != self.primary
        ]

    @property
    def num_groups(self) -> int:
        return len(self.layout)

    def blocks_for(self, per_group: int) -> int:
        """Blocks a request reserves when each group's table needs ``per_group``."""
        return per_group * self.num_groups

    # ---- tables ----------------------------------------------------------------------

    def assign(self, req: Request, fresh: list[int]) -> None:
        """Give the other groups their tables from ``fresh`` (the same length as the
        first full group's)."""
        n = len(req.blocks)
        assert len(fresh) == n * len(self.others), (len(fresh), n)
        req.group_blocks = {o.index: fresh[k * n : (k + 1) * n] for k, o in enumerate(self.others)}

    def extend(self, req: Request, fresh: list[int]) -> None:
        """A decoding request crossed into a new block: the other groups' tables grow by
        as many blocks as the first full group's (``fresh``, group after group)."""
        n = len(fresh) // max(1, len(self.others))
        for k, o in enumerate(self.others):
            req.group_blocks[o.index].extend(fresh[k * n : (k + 1) * n])

    def release_outside_window(self, req: Request, end: int) -> None:
        """Free the sliding-window blocks no token from ``end`` on will look at."""
        bs = self.block_size
        for o in self.others:
            table = req.group_blocks.get(o.index)
            if table is None or o.group.window is None:
                continue
            stop = min(window_block_range(end, o.group.window, bs).start, len(table))
            gone = [b for b in table[:stop] if b != NULL_BLOCK]
            if gone:
                table[:stop] = [NULL_BLOCK] * stop
                self.blocks.free(gone)

    def finish(self, req: Request, keep_n: int) -> tuple[list[list[int]], list[int]]:
        """A finished request: every group's list to export (first ``keep_n`` blocks,
        sliding ones clipped as vLLM exports them) and the other groups' blocks those
        lists hold; every other block of the other groups is freed here."""
        lists: list[list[int]] = [[] for _ in self.layout]
        lists[self.primary] = list(req.blocks[:keep_n])
        held: list[int] = []
        drop: list[int] = []
        for o in self.others:
            table = req.group_blocks.pop(o.index, [])
            kept = table[:keep_n]
            assert o.group.window is not None
            cut = len(kept) - exported_window_blocks(o.group.window, self.block_size)
            exported = kept[max(cut, 0) :]
            lists[o.index] = exported
            held += [b for b in exported if b != NULL_BLOCK]
            drop += [b for b in kept[: max(cut, 0)] + table[keep_n:] if b != NULL_BLOCK]
        self.blocks.free(drop)
        return lists, held

    def drop(self, req: Request) -> None:
        """Free every block the other groups hold (a request that ends holding nothing)."""
        for o in self.others:
            table = req.group_blocks.pop(o.index, [])
            self.blocks.free([b for b in table if b != NULL_BLOCK])

    # ---- KV bytes ----------------------------------------------------------------------

    def write(self, content: KVContent, req: Request, start: int, hashes: np.ndarray) -> None:
        """The other groups' KV for slots ``[start, start + len(hashes))``, then the
        window's release up to the new end."""
        for o in self.others:
            salted = hashes ^ np.uint64(o.salt)
            self.blocks.write_slots(req.group_blocks[o.index], start, content.slots(salted))
        self.release_outside_window(req, start + len(hashes))

    def window_digest(self, req: Request, n: int) -> bytes:
        """Fingerprints of what each sliding group's window sees before position ``n``
        (whole blocks, then the partial last one)."""
        bs = self.block_size
        full = n // bs
        out = bytearray()
        for o in self.others:
            assert o.group.window is not None
            table = req.group_blocks[o.index]
            window = window_block_range(n, o.group.window, bs)
            whole = [table[i] for i in range(window.start, min(window.stop, full))]
            out += o.index.to_bytes(2, "little")
            if whole:
                out += self.blocks.fingerprints(whole).astype("<u8").tobytes()
            tail = n - full * bs
            if tail and window:
                fp = self.blocks.tail_fingerprint(table[full], tail)
                out += tail.to_bytes(4, "little") + fp.to_bytes(8, "little")
        return bytes(out)

    def mismatched(
        self,
        content: KVContent,
        req: Request,
        hashes_at: np.ndarray,
        start: int,
        end: int,
    ) -> int:
        """Blocks of the other groups in ``[start, end)`` the next token's window sees
        that hold bytes other than the prompt implies (``hashes_at[i]``: slot
        ``start + i``'s prefix hash); what a read leaves outside the window is never
        looked at (it is freed at the next step)."""
        bs = self.block_size
        bad = 0
        for o in self.others:
            assert o.group.window is not None
            expected = content.slots(hashes_at ^ np.uint64(o.salt))
            table = req.group_blocks[o.index]
            seen = window_block_range(end, o.group.window, bs).start * bs
            for pos in range(max(start - start % bs, seen), end, bs):
                b = table[pos // bs]
                lo, hi = max(pos, start), min(end, pos + bs)
                if b == NULL_BLOCK or lo >= hi:
                    continue
                got = self.blocks.read_slots(b, lo - pos, hi - lo)
                if not np.array_equal(got, expected[lo - start : hi - start]):
                    bad += 1
        return bad

    # ---- reading another engine's groups ------------------------------------------------

    def pairs(
        self,
        req: Request,
        remote: Sequence[Sequence[int]],
        hit: int,
        count: int,
        *,
        suffix_trim: bool,
    ) -> tuple[list[int], list[int]]:
        """Local and remote blocks to read for tokens ``[hit, hit + count)`` of every
        group. By position: D's lists cut with ``policy.trim_groups`` (a sliding group
        whose window D freed refuses the read, :class:`PairingRefused`). ``suffix_trim``
        (vLLM's worker): each group's last local blocks with D's last ones. Freed
        entries (the null block) are never read."""
        bs = self.block_size
        if len(remote) != self.num_groups:
            raise PairingRefused(
                "group-layout-mismatch",
                f"D's params name {len(remote)} KV cache groups, this engine has {self.num_groups}",
            )
        end_block = cdiv(hit + count, bs)
        first_block = hit // bs
        if suffix_trim:
            cut: list[list[int]] = [list(g) for g in remote]
        else:
            trim = trim_groups(remote, hit + count, bs, self.layout)
            if trim.block_ids is None:
                raise PairingRefused(
                    trim.reason, f"D's groups cannot be read up to token {hit + count}"
                )
            cut = trim.block_ids
        local_out: list[int] = []
        remote_out: list[int] = []
        for index, ids in enumerate(cut):
            table = req.blocks if index == self.primary else req.group_blocks[index]
            group = self.layout[index]
            if suffix_trim:
                mine = table[first_block:end_block]
                if group.window is not None:
                    mine = mine[-exported_window_blocks(group.window, bs) :]
                theirs = suffix_trim_pairing(ids, len(mine))
            else:
                start = max(first_block, end_block - len(ids))
                mine = table[start:end_block]
                theirs = list(ids[start - (end_block - len(ids)) :])
            for lb, rb in zip(mine, theirs, strict=True):
                if rb != NULL_BLOCK and lb != NULL_BLOCK:
                    local_out.append(lb)
                    remote_out.append(rb)
        return local_out, remote_out
