"""Fixtures of the hardware tier: an external GPU P/D deployment given by URL.

The tier never starts GPU servers itself; it certifies a running deployment
(real NIXL over EFA/RDMA) reached with ``--backend external --prefill-url
--decode-url``. Without one it skips (or fails under ``--require-tier hardware``).
"""

from __future__ import annotations

import pytest

from bidir_kv.testing.gating import skip_or_fail
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.topology.base import Node

__all__ = ["gpu_pd"]


def _node(role: str, url: str) -> Node:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        raise pytest.UsageError(f"--{role}-url must look like http://host:port, got {url!r}")
    return Node(role="prefill" if role == "prefill" else "decode", name=role,
                host=parts.hostname, port=parts.port)


def _served_model(url: str) -> str:
    """The first model id ``/v1/models`` lists (what requests must name)."""
    import json
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as resp:
        models = json.loads(resp.read()).get("data") or []
    if not models:
        raise pytest.UsageError(f"{url}/v1/models lists no model; pass --hw-model")
    return str(models[0]["id"])


@pytest.fixture(scope="session")
def gpu_pd(pytestconfig: pytest.Config) -> tuple[EngineClient, EngineClient]:
    """(P, D) clients of the external deployment under test."""
    p_url = pytestconfig.getoption("--prefill-url")
    d_url = pytestconfig.getoption("--decode-url")
    if not (p_url and d_url):
        skip_or_fail(
            pytestconfig,
            "hardware",
            "no GPU P/D deployment given: pass --prefill-url and --decode-url of vLLM servers "
            "started with NixlConnector and bidirectional_kv_xfer (prefix caching off on P)",
        )
    model = pytestconfig.getoption("--hw-model") or _served_model(p_url)
    return (EngineClient(_node("prefill", p_url), model=model, timeout=600),
            EngineClient(_node("decode", d_url), model=model, timeout=600))
