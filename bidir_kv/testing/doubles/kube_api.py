"""A stand-in for the Kubernetes API server, for the kubernetes launcher's tests.

No real API server runs on this machine offline: Debian 12 packages only the client
(``kubernetes-client``: kubectl) and ``etcd-server``, not ``kube-apiserver``; PyPI has no
package carrying it, and every distribution of it (envtest's assets, kind, k3s, minikube)
downloads the binary or an image from Kubernetes' own servers (docs/hardware.md §3).

So the stand-in answers the few REST calls the launcher makes, the way the API server
would, and **validates every object it is sent against Kubernetes' OpenAPI schemas**
(``kubernetes-validate``, strict: an unknown field is an error, as the API server's
strict field validation makes it):

* ``POST /api/v1/namespaces/NS/{pods,services}``: the body must be JSON, of the kind the
  path names, in the path's namespace (400 ``BadRequest`` otherwise, the API server's
  wording), and valid against the schema (422 ``Invalid``, naming the field); a name
  already taken is 409 ``AlreadyExists``; else 201 with the object stored;
* ``GET`` of an object: 200 with it, or 404 ``NotFound``; ``DELETE``: 200, or 404;
* a bearer token other than the one given: 401 ``Unauthorized``; ``refuse`` maps a
  plural to a status for a test (e.g. ``{"services": 403}``).

Every call is recorded (``calls``) and the stored objects are inspectable
(``objects``), so a test checks that a launch left nothing behind.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["KubeApiStandIn", "kube_api_stand_in"]

_KIND = {"pods": "Pod", "services": "Service"}
_PATH = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/(?P<plural>[a-z]+)(?:/(?P<name>[^/?]+))?$")
_REASON = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "AlreadyExists",
    422: "Invalid",
}


def _status(code: int, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": _REASON.get(code, "InternalError"),
        "code": code,
    }


def schema_problem(body: dict[str, Any]) -> str | None:
    """Why ``body`` is not a valid object by Kubernetes' schemas (strict), or None."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(body, kubernetes_validate.utils.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path) or "(root)"
        return f"{where}: {exc.message}"
    except kubernetes_validate.SchemaNotFoundError as exc:
        return str(exc)
    return None


@dataclass
class KubeApiStandIn:
    """The stand-in's state: what it was asked and what it holds."""

    token: str | None = None
    refuse: dict[str, int] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, method: str, path: str, auth: str | None, raw: bytes) -> tuple[int, Any]:
        with self.lock:
            self.calls.append((method, path))
            if self.token is not None and auth != f"Bearer {self.token}":
                return 401, _status(401, "Unauthorized")
            m = _PATH.match(path)
            if m is None or m["plural"] not in _KIND:
                return 404, _status(
                    404, f"the server could not find the requested resource ({path})"
                )
            ns, plural, name = m["ns"], m["plural"], m["name"]
            if plural in self.refuse:
                code = self.refuse[plural]
                return code, _status(code, f"{plural} is refused here (stand-in, code {code})")
            if method == "POST" and name is None:
                return self._create(ns, plural, raw)
            if name is None:
                return 405, _status(405, f"{method} {path} is not supported by the stand-in")
            key = (ns, plural, name)
            if key not in self.objects:
                return 404, _status(404, f'{plural} "{name}" not found')
            if method == "GET":
                return 200, self.objects[key]
            if method == "DELETE":
                del self.objects[key]
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
            return 405, _status(405, f"{method} {path} is not supported by the stand-in")

    def _create(self, ns: str, plural: str, raw: bytes) -> tuple[int, Any]:
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return 400, _status(400, f"the body is not JSON: {exc}")
        if not isinstance(body, dict):
            return 400, _status(400, "the body is not an object")
        kind, meta = body.get("kind"), body.get("metadata") or {}
        if kind != _KIND[plural]:
            return 400, _status(
                400, f"the API version in the data ({kind}) does not match {plural}"
            )
        if meta.get("namespace", ns) != ns:
            return 400, _status(
                400,
                "the namespace of the provided object does not match the namespace sent on "
                "the request",
            )
        problem = schema_problem(body)
        if problem is not None:
            return 422, _status(422, f'{kind} "{meta.get("name", "")}" is invalid: {problem}')
        key = (ns, plural, str(meta.get("name", "")))
        if key in self.objects:
            return 409, _status(409, f'{plural} "{key[2]}" already exists')
        stored = {**body, "metadata": {**meta, "namespace": ns}}
        self.objects[key] = stored
        return 201, stored


def _handler(api: KubeApiStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            code, body = api.answer(self.command, self.path, self.headers.get("Authorization"), raw)
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _serve

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@contextmanager
def kube_api_stand_in(
    token: str | None = None, refuse: dict[str, int] | None = None
) -> Iterator[KubeApiStandIn]:
    """The stand-in, serving on a loopback port (``api.url``) for the block."""
    api = KubeApiStandIn(token=token, refuse=dict(refuse or {}))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(api))
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
