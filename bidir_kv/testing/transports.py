"""Fixtures of the transport tests: the KV agent backends, ``tcp`` always and ``nixl`` where
a NIXL agent can be created (``make test`` installs it on x86_64).

A pytest plugin (loaded by :mod:`bidir_kv.testing.plugin`).
"""

from __future__ import annotations

import pytest

from bidir_kv.engine.transport import nixl_available
from bidir_kv.testing.gating import skip_or_fail

__all__ = ["KV_BACKENDS", "kv_backend", "nixl_ok", "require_nixl"]

KV_BACKENDS = ("tcp", "nixl")


def require_nixl(config: pytest.Config) -> None:
    """Skip (or fail, when the integration tier is required) where NIXL cannot run."""
    ok, why = nixl_available()
    if not ok:
        skip_or_fail(config, "integration", f"nixl transport unavailable: {why}")


@pytest.fixture(scope="module", params=KV_BACKENDS)
def kv_backend(request: pytest.FixtureRequest) -> str:
    """Each KV agent backend in turn, one module-wide run per backend."""
    if request.param == "nixl":
        require_nixl(request.config)
    return str(request.param)


@pytest.fixture
def nixl_ok(request: pytest.FixtureRequest) -> None:
    """The test needs a NIXL agent."""
    require_nixl(request.config)
