"""A wall-clock bound on a whole blocking call, whatever the server does.

httpx's timeouts bound each connect, read or write, not the request: a server that
drips its status line, headers or body a byte at a time, each byte inside the read
timeout, keeps a request waiting for as long as it likes. :func:`within` bounds the
whole call: the call runs on a daemon thread and the caller gets its result, its
exception, or :class:`RequestTimeout` once ``seconds`` have passed. A call given up on
keeps its thread until its socket closes (a daemon thread never holds the process).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from bidir_kv.client.errors import RequestTimeout

__all__ = ["within"]

T = TypeVar("T")


def within(
    seconds: float, call: Callable[[], T], *, what: str = "request", url: str | None = None
) -> T:
    """``call()``'s result if it returns within ``seconds``; its exception if it raises;
    else :class:`RequestTimeout` naming ``what`` (and ``url``)."""
    if seconds <= 0:
        raise RequestTimeout(f"no time left for the {what}", url=url)
    done = threading.Event()
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the caller as is
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"within:{what}", daemon=True).start()
    if not done.wait(seconds):
        raise RequestTimeout(f"{what}: no whole answer within {seconds:g} s", url=url)
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
