"""One abstraction for "a set of P/D nodes + routers + stores", with pluggable backends.

Tests, ``bench`` and ``demo`` differ only in which backend they pick:
``local`` (emulated engines as processes on loopback), ``container``,
``vllm-cpu`` (real vLLM), ``external`` (URLs of a running deployment).
"""

from bidir_kv.topology.base import (
    BackendUnavailable,
    EngineSpec,
    Node,
    RouterSpec,
    Topology,
    TopologySpec,
)

__all__ = ["BackendUnavailable", "EngineSpec", "Node", "RouterSpec", "Topology", "TopologySpec"]
