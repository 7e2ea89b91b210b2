"""What the router's fault tests share (suites/integration/test_router_ops.py,
test_router_release.py): faults set on emulated engines for one test and undone after it,
and a router with fast health checks in front of a module's topology.

A pytest plugin (loaded by :mod:`bidir_kv.testing.plugin`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bidir_kv.client import fetch
from bidir_kv.testing.faults import confirm_faults
from bidir_kv.testing.router import RouterProcess

__all__ = ["Faults", "engine_faults", "router_for"]

Faults = Callable[[Any, dict[str, Any]], None]


def _faults(node: Any, changes: dict[str, Any] | None = None) -> dict[str, Any]:
    """An emulated engine's faults (``GET``), or set some of them (``POST``)."""
    url = node.url + "/_emulator/faults"
    if changes is None:
        return fetch(url, timeout=10).raise_for_status().json_object()
    return fetch(url, method="POST", json=changes, timeout=10).raise_for_status().json_object()


@pytest.fixture
def engine_faults() -> Iterator[Faults]:
    """``engine_faults(node, {"stall": True})`` sets faults on an emulated engine node and
    checks the node reports them set (else the test fails: ``fault did not take effect``);
    at teardown every fault this test set is back at the value it had before the test."""
    before: dict[str, tuple[Any, dict[str, Any]]] = {}  # node url -> (node, values before)
    changed: dict[str, set[str]] = {}

    def set_faults(node: Any, changes: dict[str, Any]) -> None:
        if node.url not in before:
            before[node.url] = (node, _faults(node))
        changed.setdefault(node.url, set()).update(changes)
        _faults(node, changes)
        confirm_faults(node.url, changes, _faults(node))  # the node took the fault

    try:
        yield set_faults
    finally:
        for url, (node, values) in before.items():
            _faults(node, {k: values[k] for k in sorted(changed[url])})


def router_for(
    topo: Any, router_process: Callable[..., RouterProcess], decode: list[Any], *flags: str
) -> RouterProcess:
    """A router of this test's own in front of ``topo``'s P nodes and the ``decode`` nodes
    given, checking their health every 0.5 s."""
    return router_process(
        [(n.host, n.port) for n in topo.prefill],
        [(n.host, n.port) for n in decode],
        extra=("--health-interval", "0.5", *flags),
    )
