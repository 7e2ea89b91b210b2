"""A deployment someone else runs (e.g. a GPU cluster), reached by URL.

Nothing is started or stopped; :meth:`ExternalTopology.start` only checks that every
node answers ``/health`` so a scenario never runs against a half-up deployment.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence

from bidir_kv.launch.process import ProcessFailed, wait_http_ok
from bidir_kv.topology.base import BackendUnavailable, Node, Role, Topology, TopologySpec

__all__ = ["ExternalTopology", "parse_node_url"]


def parse_node_url(url: str, role: Role, name: str) -> Node:
    """A :class:`Node` from ``http://host:port``; the message names a bad URL."""
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise BackendUnavailable(f"{name}: {url!r} is not an http(s)://host:port URL")
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        raise BackendUnavailable(f"{name}: {url!r} has an invalid port") from None
    if parsed.path not in ("", "/"):
        raise BackendUnavailable(
            f"{name}: {url!r} has a path; give the server root (the /v1 routes are appended)"
        )
    return Node(role=role, name=name, host=parsed.hostname, port=port, info={"url": url})


class ExternalTopology(Topology):
    """P, D and (optionally) router URLs of a running deployment."""

    backend = "external"

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        proxy_url: str | None = None,
        *,
        health_timeout: float = 10.0,
        spec: TopologySpec | None = None,
    ) -> None:
        super().__init__(
            spec
            or TopologySpec(num_prefill=len(prefill_urls), num_decode=len(decode_urls), routers=0)
        )
        if not prefill_urls or not decode_urls:
            raise BackendUnavailable("the external backend needs --prefill-url and --decode-url")
        self._urls = (list(prefill_urls), list(decode_urls), proxy_url)
        self.health_timeout = health_timeout

    def start(self) -> ExternalTopology:
        pre, dec, proxy = self._urls
        self.prefill = [parse_node_url(u, "prefill", f"prefill-{i}") for i, u in enumerate(pre)]
        self.decode = [parse_node_url(u, "decode", f"decode-{i}") for i, u in enumerate(dec)]
        self.routers = [parse_node_url(proxy, "router", "router-0")] if proxy else []
        for node in self.nodes():
            try:
                wait_http_ok(f"{node.url}/health", self.health_timeout)
            except ProcessFailed as exc:
                raise BackendUnavailable(
                    f"{node.name} at {node.url} is not healthy: {exc}"
                ) from None
        return self

    def close(self) -> None:
        """Nothing to stop: the deployment is not ours."""
