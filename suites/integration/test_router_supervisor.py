"""The ``--workers`` supervisor (bidir_kv/router/workers.py) forgets deaths older than
``--worker-death-window``: rare deaths spread over a long time never make it give up.

The supervisor runs in a child interpreter (it forks and reaps its own children, which
it must not do inside pytest) with one worker that dies as soon as it starts, a window
of 0.1 s and at most one death in it. Consecutive deaths are at least the respawn
backoff apart (``RESPAWN_DELAY_S``, 0.2 s: the supervisor waits that long before it
forks the replacement), so no two deaths ever fall in one window; the fifth worker
stops the supervisor with SIGTERM, which then exits 0. The case of deaths close
together (exit 1) is ``test_too_many_deaths_stop_the_router_with_exit_1`` in
test_router_workers.py, on a real router.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bidir_kv.router.workers import RESPAWN_DELAY_S

WINDOW = 0.1
assert RESPAWN_DELAY_S > WINDOW  # what makes these deaths "spread out"

_SUPERVISED = """
import os, signal, sys
from pathlib import Path

from bidir_kv.router.workers import run_workers

starts = Path(sys.argv[1])


def serve(index, restarts):
    with starts.open("a") as f:
        f.write("x")
    if len(starts.read_text()) == 5:  # four deaths so far: stop the supervisor
        os.kill(os.getppid(), signal.SIGTERM)
    return 1  # this worker dies


sys.exit(run_workers(1, serve, max_deaths=1, window=float(sys.argv[2])))
"""


def test_deaths_older_than_the_window_are_forgotten(tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    out = subprocess.run(
        [sys.executable, "-c", _SUPERVISED, str(starts), str(WINDOW)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "died within" not in out.stderr, out.stderr  # it never gave up
    assert out.returncode == 0, out.stderr
    assert starts.read_text() == "xxxxx"  # the first worker and four replacements
    assert out.stderr.count("replaced") == 4, out.stderr
