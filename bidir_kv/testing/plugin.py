"""The one pytest plugin: options, markers, tier marks, and the fixture modules it loads.

The root ``conftest.py`` loads this module; it registers the fixture and hook modules
listed in :data:`pytest_plugins`, so suites never import fixtures (and never import
each other). Tier gating (``skip_or_fail``) lives in :mod:`bidir_kv.testing.gating`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bidir_kv.testing.gating import REQUIRE_ENV

TIERS = {
    "unit": "pure, in-process tests; laptops, seconds",
    "integration": "emulated P/D topologies as processes or containers",
    "conformance": "backend-agnostic scenarios (emulator, real vLLM on CPU, external)",
    "hardware": "real NIXL on GPU/EFA; pytest-benchmark TTFT bounds",
}
BACKENDS = ("emulator", "vllm-cpu", "vllm-cpu+bidir-kv", "external")

# Fixture and hook modules, registered by pytest when it loads this plugin.
pytest_plugins = [
    "bidir_kv.testing.containers",  # docker_client, container_image, container_topology
    "bidir_kv.testing.engines",  # engine_pair, shared_pair
    "bidir_kv.testing.hardware",  # gpu_pd
    "bidir_kv.testing.router",  # redis_server, router_process
    "bidir_kv.testing.conformance",  # pd, router, prompts; the matrix report
]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("bidir-kv")
    group.addoption(
        "--backend",
        action="append",
        choices=BACKENDS,
        default=None,
        help="backend(s) for conformance scenarios (repeatable; default: emulator and "
        "vllm-cpu, plus external when --prefill-url is given)",
    )
    group.addoption("--prefill-url", default=None, help="external backend: prefill node URL")
    group.addoption("--decode-url", default=None, help="external backend: decode node URL")
    group.addoption(
        "--proxy-url",
        default=None,
        help="conformance: also run the through-router scenarios through this running "
        "router (it must front the external backend's P and D)",
    )
    group.addoption(
        "--proxy-cmd",
        default=None,
        help="conformance: also run the through-router scenarios through a router started "
        "by this command, per test; placeholders {python} {port} {prefill_host} "
        "{prefill_port} {decode_host} {decode_port} {block_size} {decoder_ttl} {cache_ttl}",
    )
    group.addoption(
        "--hw-prompt-tokens",
        default="4096,16384",
        help="hardware tier: comma-separated history lengths for the TTFT comparison",
    )
    group.addoption(
        "--hw-ttft-ratio-max",
        type=float,
        default=1.0,
        help="hardware tier: largest allowed median TTFT ratio readback/recompute",
    )
    group.addoption(
        "--hw-model", default=None, help="hardware tier: served model name of the deployment"
    )
    group.addoption(
        "--require-tier",
        action="append",
        default=[],
        metavar="TIER",
        help="fail (instead of skip) when TIER's infrastructure is missing; "
        f"also read from {REQUIRE_ENV} (comma-separated)",
    )


def _hypothesis_profile() -> None:
    """No per-example deadline: the machines are shared and noisy (a real vLLM pair may
    be idling beside the unit tier), and timing is never what a property asserts."""
    try:
        from hypothesis import settings
    except ImportError:
        return
    settings.register_profile("bidir-kv", deadline=None, database=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "bidir-kv"))


def pytest_configure(config: pytest.Config) -> None:
    _hypothesis_profile()
    for name, text in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test gets the marker of the tier folder it lives in (suites/<tier>/...)."""
    for item in items:
        parts = Path(str(item.fspath)).parts
        if "suites" in parts:
            idx = parts.index("suites")
            if idx + 1 < len(parts) and parts[idx + 1] in TIERS:
                item.add_marker(getattr(pytest.mark, parts[idx + 1]))


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    """A per-test folder for node logs and outputs."""
    d = tmp_path / "run"
    d.mkdir()
    yield d
