"""`bidir-kv doctor` against nodes that misbehave (a fake node on loopback sends each bad
answer): every run ends inside its bound, exit 1, a FAIL line naming the node, the
endpoint and what was wrong, and never a traceback."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bidir_kv.testing.doubles.misbehaving import Drip, FakeNode, http_answer

TIMEOUT, DEADLINE = 1.0, 6.0
BOUND = DEADLINE + 10.0  # the deadline plus the interpreter's start and exit on 2 busy cores


def _doctor(
    p: FakeNode, d: FakeNode, *extra: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bidir_kv",
            "doctor",
            "--prefill-url",
            p.url,
            "--decode-url",
            d.url,
            "--no-probe",
            "--no-host-checks",
            "--timeout",
            str(TIMEOUT),
            "--deadline",
            str(DEADLINE),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return out, time.monotonic() - t0


def _fail_lines(answers: dict[str, object]) -> tuple[str, str]:
    """The FAIL lines of a doctor run whose P misbehaves as ``answers`` say, and P's URL."""
    with FakeNode(answers) as bad, FakeNode() as good:  # type: ignore[arg-type]
        out, took = _doctor(bad, good)
    assert "Traceback" not in out.stderr + out.stdout, out.stderr
    assert out.returncode == 1, out.stdout + out.stderr
    assert took < BOUND, f"doctor took {took:.1f} s"
    fails = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert fails, out.stdout
    return "\n".join(fails), bad.url


BAD_STATUS = b"HTTP/1.1 two-hundred OK\r\n\r\n"


@pytest.mark.parametrize(
    ("path", "answer", "says"),
    [
        ("/health", Drip(0.2), "/health answered nothing in time"),
        ("/v1/models", Drip(0.2), "/v1/models answered nothing in time"),
        ("/health", BAD_STATUS, "/health answered nothing"),
        (
            "/v1/models",
            http_answer(b'{"data": [{"id": "tiny"}]}', length=500),
            "/v1/models answered nothing usable",
        ),
        ("/v1/models", http_answer([1, 2]), "/v1/models answered a JSON list, not an object"),
        ("/v1/models", http_answer({"data": "tiny"}), '"data" is str, not a list'),
        (
            "/v1/models",
            http_answer(b"<html>hi</html>"),
            "/v1/models answered 200 with a body that is not JSON",
        ),
        ("/version", http_answer(["0.33.0"]), "/version answered \"['0.33.0']\""),
        ("/version", http_answer({"version": 33}), "/version answered"),
        (
            "/health",
            http_answer(b"", headers={"Date": "the day after tomorrow"}),
            "/health sends an invalid Date header 'the day after tomorrow'",
        ),
        ("/metrics", http_answer(b"<html>metrics</html>"), "/metrics not a metrics exposition"),
        ("/metrics", Drip(0.2), "/metrics not readable (GET /metrics: no whole answer"),
    ],
    ids=[
        "health-drip",
        "models-drip",
        "bad-status-line",
        "truncated-body",
        "models-list",
        "models-data-str",
        "models-not-json",
        "version-list",
        "version-int",
        "bad-date",
        "metrics-garbage",
        "metrics-drip",
    ],
)
def test_misbehaving_node_is_a_fail_line(path: str, answer: object, says: str) -> None:
    fails, url = _fail_lines({path: answer})
    assert f"P {url}{path}" in fails, fails
    assert says in fails, fails


def test_redirect_to_another_host_is_not_followed() -> None:
    with FakeNode() as elsewhere:
        # another host: 127.0.0.2 is loopback too, and its own listener would see a request
        target = f"http://127.0.0.2:{elsewhere.port}/health"
        with (
            FakeNode(
                {"/health": http_answer(b"", status="302 Found", headers={"Location": target})}
            ) as bad,
            FakeNode() as good,
        ):
            out, took = _doctor(bad, good)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stdout + out.stderr
        assert took < BOUND
        assert (
            f"P {bad.url}/health answered 302, redirecting to {target} (not followed)" in out.stdout
        ), out.stdout
        assert elsewhere.seen == []


def test_doctor_deadline_bounds_a_run_of_slow_checks() -> None:
    """Every check on its own inside --timeout, together past --deadline: the run stops
    at the deadline with the unfinished check's FAIL line."""
    slow = {path: Drip(0.2) for path in ("/version", "/metrics")}
    with FakeNode() as p, FakeNode(slow) as d:  # type: ignore[arg-type]
        out, took = _doctor(p, d, "--timeout", "5", "--deadline", "3")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert took < 3 + 10.0
    assert f"D {d.url}/version answered nothing in time" in out.stdout, out.stdout
    assert "not asked: the doctor's deadline passed" in out.stdout, out.stdout
