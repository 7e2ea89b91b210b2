"""The container backend itself: image, one engine container, isolation and cleanup."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bidir_kv.client import COMPLETIONS_PATH, fetch, scrape
from bidir_kv.topology.base import TopologySpec
from bidir_kv.topology.container import HTTP_PORT, LABEL, ContainerTopology
from bidir_kv.topology.container_image import ImageBuild
from bidir_kv.topology.container_manifest import IMAGE_PYTHON


def test_image_runs_the_package_without_a_registry(
    docker_client: Any, container_image: ImageBuild
) -> None:
    code = (
        "import sys, bidir_kv.engine.cli, bidir_kv.router.cli, numpy, aiohttp, ssl; "
        "print(sys.version_info[:2], bidir_kv.__file__)"
    )
    out = docker_client.containers.run(
        container_image.tag,
        [IMAGE_PYTHON, "-c", code],
        remove=True,
        init=True,
        network_mode="none",  # nothing is fetched at run time
    )
    assert out.decode().strip() == "(3, 11) /app/bidir_kv/__init__.py"
    assert container_image.size_bytes > 0
    image = docker_client.images.get(container_image.tag)
    assert image.labels.get("org.bidir-kv.image") == "app"


def test_one_engine_container_serves_and_is_cleaned_up(
    docker_client: Any, container_topology: Callable[..., ContainerTopology]
) -> None:
    topo = container_topology(TopologySpec(num_prefill=1, num_decode=0, routers=0))
    (node,) = topo.prefill
    # published on loopback only, init process present, on our own network
    attrs = topo.container(node.name).attrs
    binding = attrs["HostConfig"]["PortBindings"][f"{HTTP_PORT}/tcp"][0]
    assert binding["HostIp"] == "127.0.0.1"
    assert attrs["HostConfig"]["Init"] is True
    assert attrs["Config"]["Labels"][LABEL] == topo.prefix
    assert attrs["Config"]["Labels"]["org.testcontainers.lang"] == "python"
    assert attrs["Config"]["Env"].count(f"VLLM_NIXL_SIDE_CHANNEL_HOST={node.name}") == 1
    assert list(attrs["NetworkSettings"]["Networks"]) == [topo.network.name]

    body = {"model": "tiny", "prompt": "hello from a container " * 4, "max_tokens": 5}
    out = fetch(node.url + COMPLETIONS_PATH, method="POST", json=body, timeout=30)
    out = out.raise_for_status().json()
    assert out["usage"]["completion_tokens"] == 5
    assert scrape(node.url).value("vllm:prompt_tokens_total") > 0

    name = node.name
    topo.close()
    assert docker_client.containers.list(all=True, filters={"name": name}) == []
    assert docker_client.networks.list(names=[f"{topo.prefix}-net"]) == []
