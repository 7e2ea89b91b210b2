"""The slurm and kubernetes launchers on bad input: one line naming the cause, nothing
left behind. Slurm's commands are stand-ins on PATH (no Slurm daemons here); the
Kubernetes API is a local HTTP server answering as the API server does."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from bidir_kv.launch.kubernetes import KubeApi, KubeLauncher
from bidir_kv.launch.process import free_port
from bidir_kv.launch.remote import LaunchFailed
from bidir_kv.launch.slurm import allocation
from bidir_kv.serve.command import recipe_pair
from bidir_kv.serve.kubernetes import KubeOptions, manifests


def _fake(bin_dir: Path, name: str, script: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)


def test_slurm_allocation_with_one_node_fails_in_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake(tmp_path, "scontrol", "echo node-a")
    _fake(tmp_path, "srun", f"touch {tmp_path}/srun-called")
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(LaunchFailed) as failure:
        allocation({"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node-a"})
    text = str(failure.value)
    assert text == "slurm: job 42 has 1 node(s) (node-a); P and D need 2 (salloc -N 2)"
    assert not (tmp_path / "srun-called").exists()
    assert allocation({"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node-[a-b]"}, need=1).nodes == (
        "node-a",
    )


def test_slurm_outside_an_allocation_or_without_slurm() -> None:
    with pytest.raises(LaunchFailed, match=r"^slurm: not inside an allocation"):
        allocation({})


class _Api(BaseHTTPRequestHandler):
    """Creates pods, refuses services (403), records every call."""

    calls: ClassVar[list[tuple[str, str]]] = []

    def _send(self, code: int, body: dict) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_POST(self) -> None:
        self.calls.append(("POST", self.path))
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path.endswith("/services"):
            self._send(
                403,
                {
                    "kind": "Status",
                    "status": "Failure",
                    "code": 403,
                    "reason": "Forbidden",
                    "message": "services is forbidden: User "
                    '"ci" cannot create resource "services" in namespace "default"',
                },
            )
        else:
            self._send(201, {"kind": "Pod"})

    def do_DELETE(self) -> None:
        self.calls.append(("DELETE", self.path))
        self._send(200, {"kind": "Status", "status": "Success"})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_api() -> Iterator[str]:
    _Api.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_kubernetes_api_error_fails_in_one_line_and_deletes_what_it_created(
    fake_api: str,
) -> None:
    p, _d = recipe_pair("m", "10.0.0.1", "10.0.0.2")
    docs = manifests([p], KubeOptions(name="rel"))
    with pytest.raises(LaunchFailed) as failure:
        KubeLauncher(KubeApi(fake_api, token="t")).start(docs)
    text = str(failure.value)
    assert "\n" not in text
    assert text.startswith(
        f"kubernetes API {fake_api}: creating service rel-prefill: 403 "
        "Forbidden: services is forbidden"
    ), text
    assert _Api.calls == [
        ("POST", "/api/v1/namespaces/default/pods"),
        ("POST", "/api/v1/namespaces/default/services"),
        ("DELETE", "/api/v1/namespaces/default/pods/rel-prefill"),
    ]


def test_kubernetes_api_unreachable_fails_in_one_line() -> None:
    p, _d = recipe_pair("m", "10.0.0.1", "10.0.0.2")
    port = free_port()  # nothing listens there
    with pytest.raises(LaunchFailed) as failure:
        KubeLauncher(KubeApi(f"http://127.0.0.1:{port}")).start(manifests([p], KubeOptions()))
    text = str(failure.value)
    assert "\n" not in text and text.startswith(
        f"kubernetes API http://127.0.0.1:{port}: creating pod bidir-kv-prefill: ConnectError"
    )
