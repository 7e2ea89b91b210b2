"""Fixtures for the container backend of the integration tier (real Docker).

``container_image`` builds (or finds cached) the project image once per
session; ``container_topology`` is a factory that starts a
:class:`~bidir_kv.topology.container.ContainerTopology` and always removes its
containers and network, also when the test or the start fails. Missing Docker
skips with the reason (or fails under ``--require-tier integration`` / CI).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.testing.gating import skip_or_fail
from bidir_kv.topology.base import BackendUnavailable, TopologySpec
from bidir_kv.topology.container import ContainerTopology, testcontainers_env
from bidir_kv.topology.container_image import ImageBuild, ensure_image

__all__ = ["container_image", "container_topology", "docker_client"]


@pytest.fixture(scope="session")
def docker_client(pytestconfig: pytest.Config) -> Iterator[Any]:
    """A docker SDK client for a reachable engine (skip/fail naming what is missing)."""
    testcontainers_env()
    try:
        import docker
    except ImportError as exc:
        skip_or_fail(pytestconfig, "integration", f"docker SDK not installed ({exc})")
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except Exception as exc:  # the SDK raises several unrelated types for "no daemon"
        skip_or_fail(
            pytestconfig,
            "integration",
            f"no Docker engine reachable ({type(exc).__name__}: {exc}); "
            "run ci/provision.d/docker.sh as root",
        )
    yield client
    client.close()


@pytest.fixture(scope="session")
def container_image(pytestconfig: pytest.Config, docker_client: Any) -> ImageBuild:
    """The project image (host-Python base + package), built once, cached by content hash."""
    try:
        return ensure_image(docker_client)
    except BackendUnavailable as exc:
        skip_or_fail(pytestconfig, "integration", f"cannot build the container image: {exc}")


@pytest.fixture
def container_topology(
    container_image: ImageBuild, run_dir: Path
) -> Iterator[Callable[..., ContainerTopology]]:
    """Factory: ``topo = container_topology(spec)`` starts it; teardown removes everything."""
    started: list[ContainerTopology] = []

    def start(spec: TopologySpec, **kwargs: Any) -> ContainerTopology:
        topo = ContainerTopology(
            spec, run_dir / f"topology-{len(started)}", image=container_image.tag, **kwargs
        )
        started.append(topo)
        topo.start()
        return topo

    try:
        yield start
    finally:
        for topo in reversed(started):
            topo.close()
