"""The ``kubernetes`` launcher: P and D as pods, created and deleted through the
Kubernetes API (the manifests of :mod:`bidir_kv.serve.kubernetes`).

:class:`KubeApi` speaks the API's REST endpoints over httpx: the server and bearer token
come from the arguments, or in a pod from the service account
(``KUBERNETES_SERVICE_HOST``, ``/var/run/secrets/kubernetes.io/serviceaccount``). An API
error (the server's ``Status`` object: code, reason, message) becomes one line naming the
resource; everything created before it is deleted again, so a failed launch leaves
nothing behind. :meth:`KubePod.stop` deletes the pod and its Service.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bidir_kv.launch.remote import LaunchFailed

__all__ = ["KubeApi", "KubeLauncher", "KubePod"]

_SA = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_PLURAL = {"Pod": "pods", "Service": "services"}


def _path(kind: str, namespace: str, name: str | None = None) -> str:
    base = f"/api/v1/namespaces/{namespace}/{_PLURAL[kind]}"
    return f"{base}/{name}" if name else base


class KubeApi:
    """The few calls the launcher makes; each failure is a one-line :class:`LaunchFailed`."""

    def __init__(
        self,
        server: str | None = None,
        token: str | None = None,
        verify: bool | str = True,
        timeout: float = 30.0,
    ) -> None:
        if server is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            host = os.environ["KUBERNETES_SERVICE_HOST"]
            server = f"https://{host}:{os.environ.get('KUBERNETES_SERVICE_PORT', '443')}"
            token = token or (_SA / "token").read_text().strip()
            verify = str(_SA / "ca.crt") if verify is True else verify
        if server is None:
            raise LaunchFailed("kubernetes: no API server (pass --kube-api or run in a pod)")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.server = server.rstrip("/")
        self._http = httpx.Client(
            base_url=self.server, headers=headers, verify=verify, timeout=timeout
        )

    def _call(
        self, method: str, path: str, what: str, body: Any = None, ok_missing: bool = False
    ) -> httpx.Response:
        try:
            resp = self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise LaunchFailed(
                f"kubernetes API {self.server}: {what}: {type(exc).__name__}: {exc}"
            ) from None
        if resp.status_code == 404 and ok_missing:
            return resp
        if resp.status_code >= 400:
            try:
                status = resp.json()
                detail = f"{status.get('reason', '')}: {status.get('message', '')}".strip(": ")
            except ValueError:
                detail = resp.text.strip().splitlines()[0] if resp.text.strip() else ""
            raise LaunchFailed(f"kubernetes API {self.server}: {what}: {resp.status_code} {detail}")
        return resp

    def create(self, doc: Mapping[str, Any]) -> None:
        meta = doc["metadata"]
        self._call(
            "POST",
            _path(doc["kind"], meta["namespace"]),
            f"creating {doc['kind'].lower()} {meta['name']}",
            body=doc,
        )

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self._call(
            "DELETE",
            _path(kind, namespace, name),
            f"deleting {kind.lower()} {name}",
            ok_missing=True,
        )

    def phase(self, namespace: str, name: str) -> tuple[str, bool]:
        """(pod phase, ready)."""
        pod = self._call("GET", _path("Pod", namespace, name), f"reading pod {name}").json()
        status = pod.get("status", {})
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions", [])
        )
        return str(status.get("phase", "Unknown")), ready

    def log(self, namespace: str, name: str) -> str:
        return self._call(
            "GET",
            _path("Pod", namespace, name) + "/log",
            f"reading the log of pod {name}",
            ok_missing=True,
        ).text


@dataclass
class KubePod:
    """A pod (and its Service) the launcher created."""

    name: str
    namespace: str
    api: KubeApi
    created: list[tuple[str, str]] = field(default_factory=list)  # (kind, name)
    stopped: str | None = field(default=None, init=False)

    @property
    def where(self) -> str:
        return f"pod {self.namespace}/{self.name}"

    def fetch_log(self, dest: Path) -> Path:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(self.api.log(self.namespace, self.name))
        return dest

    def stop(self, timeout: float = 30.0) -> str:
        if self.stopped is None:
            errors = []
            for kind, name in reversed(self.created):
                try:
                    self.api.delete(kind, self.namespace, name)
                except LaunchFailed as exc:
                    errors.append(str(exc))
            self.stopped = "; ".join(errors) or f"{self.where}: deleted"
        return self.stopped


@dataclass(frozen=True)
class KubeLauncher:
    api: KubeApi

    def start(self, docs: list[dict[str, Any]]) -> KubePod:
        """Create one node's Pod and Service; on an API error delete what was created and
        raise the error's one line."""
        pod_doc = next(d for d in docs if d["kind"] == "Pod")
        meta = pod_doc["metadata"]
        pod = KubePod(meta["name"], meta["namespace"], self.api)
        try:
            for doc in docs:
                self.api.create(doc)
                pod.created.append((doc["kind"], doc["metadata"]["name"]))
        except LaunchFailed:
            pod.stop()
            raise
        return pod
