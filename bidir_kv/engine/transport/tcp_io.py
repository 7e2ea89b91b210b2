"""Helpers both ends of the TCP transport share: block runs, pool rows, socket tuning.

Bulk data moves with ``loop.sock_sendall``/``loop.sock_recv_into`` on memoryviews of the
pools, so no per-block Python copies are made; consecutive block ids go as one run.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from bidir_kv.engine.transport.base import KVPool, KVTransportError

__all__ = ["block_runs", "check_ids", "pool_rows", "tune"]

_SOCK_BUF = 4 * 1024 * 1024


def block_runs(blocks: Sequence[int]) -> Iterator[tuple[int, int]]:
    """``(start, count)`` runs of consecutive ids, in order: one syscall stream per run."""
    i = 0
    n = len(blocks)
    while i < n:
        start = blocks[i]
        j = i + 1
        while j < n and blocks[j] == start + (j - i):
            j += 1
        yield start, j - i
        i = j


def pool_rows(pool: KVPool, start: int, count: int) -> memoryview:
    """Rows ``start .. start + count`` of ``pool`` as one flat view (no copy)."""
    rows: Any = pool.data[start : start + count].reshape(-1)
    return memoryview(rows)


def tune(sock: socket.socket) -> None:
    """Non-blocking, no Nagle delay, large buffers (best effort)."""
    sock.setblocking(False)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)


def check_ids(ids: Any, num_blocks: int, what: str) -> list[int]:
    """``ids`` as a list of block ids of a pool of ``num_blocks``; anything else refused."""
    if not isinstance(ids, list | tuple):
        raise KVTransportError(f"{what} block ids must be a list, got {type(ids).__name__}")
    if set(map(type, ids)) <= {int} and (not ids or (min(ids) >= 0 and max(ids) < num_blocks)):
        return list(ids)  # the usual exact ints (~1,500 at 24k tokens): a few C passes
    out: list[int] = []
    for b in ids:
        if isinstance(b, bool) or not isinstance(b, int | np.integer):
            raise KVTransportError(f"{what} block id {b!r} is not an integer")
        if not 0 <= int(b) < num_blocks:
            raise KVTransportError(
                f"{what} block id {int(b)} out of range for a pool of {num_blocks} blocks"
            )
        out.append(int(b))
    return out
