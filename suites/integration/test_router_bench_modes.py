"""``python -m bidir_kv.tools.router_bench``'s modes of issue #30, run for a second each.

The benchmark is a measuring command, not a test; this only checks that its modes do
what their names say: the prefix modes (clients that send back a recorded answer, no id)
are served by hits, on the memory store and on a Redis store filled with
``--prefill-entries`` turns, and ``--baseline`` runs another tree's router beside ours.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bidir_kv.paths import REPO_ROOT
from bidir_kv.testing.gating import skip_or_fail

pytestmark = pytest.mark.integration

MODES = ("router-id", "router-prefix", "router-redis-prefix", "baseline-redis-id")


def test_prefix_and_baseline_modes_are_served_by_hits(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if shutil.which("redis-server") is None:
        skip_or_fail(request.config, "integration", "redis-server binary not found")
    out = tmp_path / "cells.json"
    argv = [
        sys.executable,
        "-m",
        "bidir_kv.tools.router_bench",
        "--concurrency",
        "2",
        "--duration",
        "1",
        "--rounds",
        "1",
        "--modes",
        *MODES,
        "--prefill-entries",
        "300",
        "--baseline",
        str(REPO_ROOT),
        "--json",
        str(out),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "300 turns filled into the Redis store" in done.stdout
    cells = {c["mode"]: c for c in json.loads(out.read_text())}
    assert set(cells) == set(MODES)
    assert all(c["errors"] == 0 and c["n"] > 0 for c in cells.values()), cells
    for mode in MODES:
        hits = re.search(rf"  {mode}: .* cache hits (\d+) of (\d+) requests", done.stdout)
        assert hits is not None, done.stdout
        # 5-turn conversations: 4 of every 5 turns continue one (first turns and turns
        # cut short by the cell's end are not)
        assert int(hits.group(1)) >= 0.5 * int(hits.group(2)), (mode, hits.group(0))
    assert "router-redis-prefix / baseline-redis-id CPU per request" in done.stdout
