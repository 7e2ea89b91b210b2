"""`bidir-kv doctor --timeout` bounds every request on its own, not only the whole run
(--deadline): a node that accepts a connection and never answers fails that request
after --timeout, and the checks after it are still asked. The doctor runs in this
process against fake nodes on loopback (bidir_kv.testing.doubles.misbehaving)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from bidir_kv.doctor.cli import main
from bidir_kv.testing.doubles.misbehaving import FakeNode

pytestmark = pytest.mark.unit


@pytest.fixture
def never_answers() -> Iterator[object]:
    """An answer that reads the request and says nothing until the test ends."""
    hold = threading.Event()

    def silent(_conn: socket.socket) -> None:
        hold.wait(60)

    yield silent
    hold.set()


def test_a_node_that_never_answers_fails_each_request_after_the_timeout(
    never_answers: object, capsys: pytest.CaptureFixture[str]
) -> None:
    silent = {"/version": never_answers, "/metrics": never_answers}
    with FakeNode() as p, FakeNode(silent) as d:  # type: ignore[arg-type]
        code = main(
            [
                "--prefill-url",
                p.url,
                "--decode-url",
                d.url,
                "--no-probe",
                "--no-host-checks",
                "--timeout",
                "0.5",
                "--deadline",
                "15",
                "--json",
            ]
        )
        asked = list(d.seen)
    results = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert code == 1
    details = " | ".join(r["detail"] for r in results.values())
    # each silent request failed on its own (--timeout: the doctor's whole-answer bound
    # or the client's read timeout, both 0.5 s, whichever fires first)...
    assert f"D {d.url}/version answered nothing in time (" in details, details
    assert f"D {d.url}/metrics not readable (" in details, details
    # ...so the run never came near the deadline: every check was asked and finished
    assert "deadline" not in details and "no time left" not in details, details
    assert asked.count("/metrics") >= 1 and asked.count("/version") >= 1, asked
