"""One abstraction for "a set of P/D nodes + routers + stores", with pluggable backends.

Reading path: ``base`` (specs and handles, independent of how nodes start), then one
backend: ``local`` (processes), ``container`` (with ``container_image``), ``vllm_cpu``
(``vllm serve`` commands built by ``bidir_kv.serve``) or ``external``. Processes are run
through ``bidir_kv.launch``.

A *backend* is how the nodes are run, and nothing else in the project is called
that: ``local`` (emulated engines as processes on loopback; the ``emulator`` of
pytest's ``--backend``), ``container`` (emulated engines in Docker containers),
``vllm-cpu`` (real vLLM on this machine's CPU), ``external`` (URLs of a running
deployment). Tests, ``bench`` and ``demo`` differ only in which backend they pick;
:class:`BackendUnavailable` says why one cannot run here.
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
