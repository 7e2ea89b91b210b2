"""``wait_http_ok``: the readiness wait every topology backend shares."""

from __future__ import annotations

import time

import pytest

from bidir_kv.launch.process import ProcessFailed, free_port, wait_http_ok


def test_a_server_that_is_gone_ends_the_wait_at_once_naming_why() -> None:
    url = f"http://127.0.0.1:{free_port()}/health"  # nothing listens there
    checks: list[float] = []

    def gone() -> str | None:
        checks.append(time.monotonic())
        return "container is exited" if len(checks) >= 2 else None

    with pytest.raises(ProcessFailed, match=f"container is exited before {url} was ready"):
        wait_http_ok(url, 60.0, gone=gone)
    assert len(checks) == 2  # asked before every probe, not only at the deadline


def test_without_a_server_the_wait_ends_at_its_timeout_with_the_last_error() -> None:
    url = f"http://127.0.0.1:{free_port()}/health"
    with pytest.raises(ProcessFailed, match=r"not ready after 0 s .*Connection refused"):
        wait_http_ok(url, 0.2)
