"""Engine-to-engine notifications: the completion message and the heartbeat, built and parsed.

Both travel as transport notifications (bytes) in vLLM's NixlConnector format, so a
reader and an owner of different builds still understand each other:

* completion ``"<request_id>:<n>"``: the reader is done with the owner's blocks; ``n``
  is how many readers the owner should wait for (always 1 here, more under
  heterogeneous TP);
* heartbeat ``"HB:<id>,<id>,..."``: the reader still wants the owner's leased blocks.

Both ends use this module, so the format is written once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from bidir_kv.errors import KVTransferError
from bidir_kv.wire.ids import RequestId

__all__ = [
    "HEARTBEAT_PREFIX",
    "Heartbeat",
    "MalformedNotification",
    "ReadDone",
    "heartbeat",
    "parse",
    "read_done",
]

# This format's version is ``bidir_kv.wire.versions.NOTIFICATIONS`` (vLLM 0.33's format);
# an incompatible change below adds a line to its history there.
HEARTBEAT_PREFIX = "HB:"
_ID_SEPARATOR = ","
_COUNT_SEPARATOR = ":"


class MalformedNotification(KVTransferError, ValueError):
    """A completion notification without a parsable consumer count."""


@dataclass(frozen=True, slots=True)
class ReadDone:
    """``"<request_id>:<consumers>"``: a reader finished with the owner's blocks."""

    request_id: RequestId
    consumers: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """``"HB:<ids>"``: the reader still needs these leases."""

    request_ids: tuple[str, ...]


def read_done(request_id: RequestId, consumers: int = 1) -> str:
    """The completion message for ``request_id``."""
    return f"{request_id}{_COUNT_SEPARATOR}{consumers}"


def heartbeat(request_ids: Iterable[str]) -> str:
    """The heartbeat message naming ``request_ids``."""
    return HEARTBEAT_PREFIX + _ID_SEPARATOR.join(request_ids)


def parse(text: str) -> ReadDone | Heartbeat:
    """Read one decoded notification.

    Empty ids in a heartbeat are dropped; a completion count below 1 counts as 1.
    Raises :class:`MalformedNotification` when a completion has no ``:<int>`` suffix.
    """
    if text.startswith(HEARTBEAT_PREFIX):
        ids = text[len(HEARTBEAT_PREFIX) :].split(_ID_SEPARATOR)
        return Heartbeat(tuple(i for i in ids if i))
    request_id, sep, count = text.rpartition(_COUNT_SEPARATOR)
    if not sep:
        raise MalformedNotification(text)
    try:
        consumers = max(1, int(count))
    except ValueError:
        raise MalformedNotification(text) from None
    return ReadDone(request_id, consumers)
