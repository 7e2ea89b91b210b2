"""Which vLLM releases the connector is written against, and the refusal for others.

The connector subclasses private classes of vLLM's NIXL connector
(``vllm.distributed.kv_transfer.kv_connector.v1.nixl``), whose names and call
shapes change between releases; on a release we have not read, loading would
either fail deep inside the engine or, worse, silently skip a fix. So it refuses
up front and names what it supports (docs/connector.md, "Supported versions").
"""

from __future__ import annotations

import re

from bidir_kv.errors import KVTransferError

__all__ = ["SUPPORTED_VLLM", "UnsupportedVllm", "check_vllm_version", "release_of"]

SUPPORTED_VLLM: tuple[str, ...] = ("0.32", "0.33")  # major.minor; any patch level

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.|$|[^0-9])")


class UnsupportedVllm(KVTransferError, RuntimeError):
    """Raised when the installed vLLM is not one the connector was written for."""


def release_of(version: str) -> str | None:
    """``major.minor`` of a vLLM version string (``"0.32.0+cpu"`` -> ``"0.32"``)."""
    m = _RELEASE.match(version)
    return f"{int(m.group(1))}.{int(m.group(2))}" if m else None


def check_vllm_version(version: str) -> str:
    """The supported release ``version`` belongs to; :class:`UnsupportedVllm` otherwise."""
    release = release_of(version)
    if release not in SUPPORTED_VLLM:
        supported = ", ".join(f"{r}.x" for r in SUPPORTED_VLLM)
        raise UnsupportedVllm(
            f"bidir_kv.connector supports vLLM {supported}; this is vLLM {version!r}. "
            "Use vLLM's own NixlConnector there, or a bidir-kv release that supports it."
        )
    return release
