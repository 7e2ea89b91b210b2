"""A fake node that misbehaves on purpose: a real socket server on loopback that answers
each path with raw bytes of our choosing (a bad status line, a truncated body, a
redirect to another host, a Date that is not a date, JSON of the wrong type, a slow
drip), for the doctor's tests. Unlisted paths get a healthy node's answer, so one
fault at a time reaches the check that owns it.
"""

from __future__ import annotations

import email.utils
import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

__all__ = ["Drip", "FakeNode", "http_answer"]

MODEL = "tiny"
METRICS = (
    b"# TYPE vllm:nixl_num_failed_transfers counter\n"
    b"vllm:nixl_num_failed_transfers_total 0.0\n"
    b"# TYPE vllm:nixl_num_kv_expired_reqs counter\n"
    b"vllm:nixl_num_kv_expired_reqs_total 0.0\n"
)


def http_answer(
    body: bytes | str | object,
    *,
    status: str = "200 OK",
    headers: dict[str, str] | None = None,
    length: int | None = None,
) -> bytes:
    """Raw bytes of an HTTP/1.1 answer; ``length`` overrides Content-Length (a lie
    truncates the body), a ``Date`` header is added unless ``headers`` has one."""
    if isinstance(body, str):
        raw = body.encode()
    elif isinstance(body, bytes):
        raw = body
    else:
        raw = json.dumps(body).encode()
    hdrs = {
        "Date": email.utils.formatdate(usegmt=True),
        "Connection": "close",
        "Content-Type": "application/json",
        **(headers or {}),
    }
    hdrs["Content-Length"] = str(len(raw) if length is None else length)
    head = f"HTTP/1.1 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    return head.encode() + b"\r\n" + raw


@dataclass(frozen=True)
class Drip:
    """An answer sent one byte every ``every`` seconds (forever, once the bytes run
    out: the last byte repeats as header padding), each byte inside any read timeout."""

    every: float = 0.2


Answer = bytes | Drip | Callable[[socket.socket], None]


def healthy() -> dict[str, Answer]:
    return {
        "/health": http_answer(b""),
        "/v1/models": http_answer({"object": "list", "data": [{"id": MODEL}]}),
        "/version": http_answer({"version": "0.33.0"}),
        "/metrics": http_answer(METRICS, headers={"Content-Type": "text/plain"}),
    }


@dataclass
class FakeNode:
    """``with FakeNode({"/health": http_answer(...)}) as node: node.url``; ``seen`` lists
    the paths asked, in order."""

    answers: dict[str, Answer] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.answers = {**healthy(), **self.answers}
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-node", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 65536:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                path = head.split(b" ", 2)[1].decode(errors="replace").split("?")[0]
                self.seen.append(path)
                answer = self.answers.get(
                    path, http_answer({"detail": "Not Found"}, status="404 Not Found")
                )
                if isinstance(answer, Drip):
                    self._drip(conn, answer)
                elif isinstance(answer, bytes):
                    conn.sendall(answer)
                else:
                    answer(conn)
            except OSError:
                return

    def _drip(self, conn: socket.socket, drip: Drip) -> None:
        data = b"HTTP/1.1 200 OK\r\nX-Pad: "
        i = 0
        while not self._stop.is_set():
            conn.sendall(data[i : i + 1] if i < len(data) else b"a")
            i += 1
            self._stop.wait(drip.every)
