"""Our engine-to-engine wire: the side channel and the TCP data port.

Both ends of every exchange take their names from here (its version from
:mod:`bidir_kv.wire.versions`): the side-channel server and ``handshake()``; the TCP
owner and reader; each agent's ``metadata()`` and the ``add_peer()`` that checks it.
The formats are drawn in ``docs/transports.md``. This is our own wire, not vLLM's
(vLLM's side channel is ZMQ), so only our engines speak it.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

__all__ = [
    "BLOCKS",
    "ERROR",
    "FENCE_BASE",
    "FENCE_SLOTS",
    "FRAME_HEADER",
    "MAX_FRAME",
    "MESSAGE",
    "META",
    "NBYTES",
    "NIXL",
    "NIXL_METADATA",
    "NOTIFICATION",
    "NOW",
    "OK",
    "OP",
    "OP_DONE",
    "OP_GET_META",
    "OP_NOTIF",
    "OP_PING",
    "OP_READ",
    "OP_WORD",
    "SENDER",
    "SLOT",
    "TCP",
    "TCP_METADATA",
    "TRANSPORT",
    "VERSION",
    "WORD",
    "accept",
    "refusal",
    "refuse",
]

# The version of what this module describes is ``bidir_kv.wire.versions.TRANSPORT``: add
# a line to its history on any incompatible change. It is the ``v`` of every side-channel
# request and of every agent metadata blob, and the connector version in the
# compatibility hash, so engines of two wire versions refuse each other at the
# handshake. vLLM's own connector version (15 in 0.33.0, docs/protocol.md §3.6) is
# independent of it.

# -- frames: a 4-byte big-endian length, then that many bytes of one msgpack map ----------
FRAME_HEADER = struct.Struct(">I")
MAX_FRAME = 16 * 1024 * 1024  # control frames only; agent metadata blobs are KBs

# -- keys every control map may carry ------------------------------------------------------
OP = "op"  # a request's operation
VERSION = "v"  # versions.TRANSPORT.version, in side-channel requests and agent metadata
OK = "ok"  # every answer: True, or False with ERROR
ERROR = "error"

# -- side channel (reader -> engine's listener), one answer per request --------------------
OP_GET_META = "get_meta"  # answer: META (EngineMetadata.to_wire()) and NOW
OP_PING = "ping"  # answer: NOW
META = "meta"
NOW = "now"  # the responder's perf_counter(), for the clock offset

# -- agent metadata (KVAgent.metadata(), carried inside META) ------------------------------
TRANSPORT = "transport"  # which agent wrote the blob: TCP or NIXL (also KVAgent.backend)
TCP = "tcp"
NIXL = "nixl"
# The fields after TRANSPORT and VERSION, with their types, per transport.
TCP_METADATA: dict[str, type] = {
    "name": str,
    "host": str,
    "port": int,
    "num_blocks": int,
    "block_nbytes": int,
}
NIXL_METADATA: dict[str, type] = {
    "name": str,
    "agent_md": bytes,
    "base": int,
    "num_blocks": int,
    "block_nbytes": int,
}

# -- TCP data port (reader -> owner) ---------------------------------------------------------
# OP_READ {SENDER, BLOCKS, NOTIFICATION} -> accept({NBYTES}), NBYTES raw bytes of the rows;
#   then OP_DONE -> accept(), after which the owner delivers NOTIFICATION.
# OP_NOTIF {SENDER, MESSAGE} -> accept(), after delivering MESSAGE.
OP_READ = "read"
OP_NOTIF = "notif"
OP_DONE = "done"
SENDER = "from"  # the reader's agent name: the peer the owner's engine is told of
BLOCKS = "blocks"  # owner's block ids to stream, in order
NOTIFICATION = "notif"  # delivered to the owner's engine once the reader has every byte
MESSAGE = "msg"  # a notify-only message (e.g. a heartbeat)
NBYTES = "nbytes"  # bytes of raw rows that follow the owner's accept()

# -- the fence (docs/connector.md §5) ------------------------------------------------------
# Optional fields, a compatible addition (no line in TRANSPORT's history): an owner with
# fence words adds FENCE_SLOTS to its TCP metadata (FENCE_BASE too for NIXL), and only a
# reader that saw them sends OP_WORD.
# OP_WORD {SLOT} -> accept({WORD}): the current value of one fence word, no notification.
OP_WORD = "word"
SLOT = "slot"
WORD = "word"
FENCE_SLOTS = "fence_slots"  # agent metadata: number of fence words
FENCE_BASE = "fence_base"  # NIXL agent metadata: address of the registered words


def accept(fields: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A positive answer carrying ``fields``."""
    return {OK: True, **(fields or {})}


def refuse(error: str) -> dict[str, Any]:
    """A negative answer; the connection stays usable."""
    return {OK: False, ERROR: error}


def refusal(answer: dict[str, Any]) -> str | None:
    """Why ``answer`` refuses, or ``None`` if it accepts."""
    if answer.get(OK):
        return None
    return str(answer.get(ERROR))
