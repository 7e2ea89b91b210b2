"""bidir-kv's connector for real vLLM: NixlConnector with the defects our suite found fixed.

Reading path: ``rules`` (the decisions, pure and unit-tested without vLLM) and
``fence`` (the scheduler's fence and budget state, and the typed ``FenceMeta`` it sends
its worker; pure too), then ``nixl`` (the vLLM subclasses that call them) and
``worker``; ``versions`` names the vLLM releases it supports. The keys D adds to its
params are in ``bidir_kv.wire.params``.

Load it in vLLM with (docs/connector.md)::

    --kv-transfer-config '{"kv_connector": "NixlConnector",
                           "kv_connector_module_path": "bidir_kv.connector", ...}'

``NixlConnector`` here is :class:`~bidir_kv.connector.nixl.BidirKVConnector` (also
exported under that name); keeping vLLM's name keeps vLLM's own NixlConnector
config checks in force. This package imports without vLLM: the vLLM-facing classes
are imported on first access, which also checks the vLLM release.
"""

from __future__ import annotations

from typing import Any

from bidir_kv.connector.versions import SUPPORTED_VLLM, UnsupportedVllm, check_vllm_version

__all__ = [
    "SUPPORTED_VLLM",
    "BidirKVConnector",
    "BidirKVScheduler",
    "NixlConnector",
    "UnsupportedVllm",
    "check_vllm_version",
]

_LAZY = {
    "BidirKVConnector": "BidirKVConnector",
    "NixlConnector": "BidirKVConnector",
    "BidirKVScheduler": "BidirKVScheduler",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from bidir_kv.connector import nixl

        return getattr(nixl, _LAZY[name])
    raise AttributeError(f"module 'bidir_kv.connector' has no attribute {name!r}")
