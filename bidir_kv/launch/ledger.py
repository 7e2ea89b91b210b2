"""A ledger of server starts: one JSON line per real vLLM server that came up.

Starting a real vLLM server on CPU costs 30-60 s, and a test suite that starts one more
than it needs costs that much on every run. The conformance and hardware tiers therefore
keep count: when ``$BIDIR_KV_SERVER_LEDGER`` names a file, every start (and restart) of a
vLLM server appends one line there: what started, for which test (pytest's
``PYTEST_CURRENT_TEST``, inherited by the ``bench`` subprocesses a test runs), with which
configuration, how long it took to answer ``/health`` and the CPU its process tree used
to get there; every stop appends how long it lived and the CPU it used in all. The
pytest plugin sets the variable and prints the totals at the end of the session
(docs/testing.md §3).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["LEDGER_ENV", "read", "record", "starts"]

LEDGER_ENV = "BIDIR_KV_SERVER_LEDGER"


def record(
    kind: str,
    name: str,
    seconds: float,
    config: Mapping[str, Any],
    cpu_seconds: float | None = None,
) -> None:
    """Append one event to the ledger, if there is one. ``kind``: ``start`` or ``restart``
    (``seconds`` until ``/health``), or ``stop`` (``seconds`` the server lived);
    ``config``: what distinguishes this server from the others (JSON-able);
    ``cpu_seconds``: what its process tree used by then."""
    path = os.environ.get(LEDGER_ENV)
    if not path:
        return
    line = {
        "at": round(time.time(), 1),
        "kind": kind,
        "name": name,
        "seconds": round(seconds, 1),
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
        "pid": os.getpid(),
        "config": dict(config),
        "cpu_seconds": None if cpu_seconds is None else round(cpu_seconds, 1),
    }
    # one short line per write with O_APPEND: lines from several processes never mix
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line, sort_keys=True, default=str) + "\n")


def read(path: str | Path) -> list[dict[str, Any]]:
    """The ledger's lines (an absent file is an empty ledger)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [json.loads(ln) for ln in text.splitlines() if ln.strip()]


def starts(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The starts and restarts among a ledger's lines."""
    return [ln for ln in lines if ln.get("kind") in ("start", "restart")]
