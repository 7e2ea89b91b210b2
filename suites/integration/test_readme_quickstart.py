"""README's quick start, run exactly as written (only the ports rewritten to free ones).

Why: a hand-run recipe rots unless something runs it. The block after
``<!-- quickstart -->`` in README.md is split into its commands; those ending in ``&``
start in the background (each its own process group, killed at the end even on
failure), the others run to completion and must succeed. Then the router must have
counted hits and P must have read tokens from D (``source="p2p"``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from bidir_kv.client import scrape
from bidir_kv.launch.process import ManagedProcess, free_port
from bidir_kv.paths import REPO_ROOT

pytestmark = pytest.mark.integration

PORTS = ("8000", "8100", "8200", "5600", "5601")


def quickstart_commands(readme: str) -> list[str]:
    """The commands of the fenced block after the ``<!-- quickstart -->`` marker."""
    after = readme.split("<!-- quickstart -->", 1)[1]
    block = re.search(r"```bash\n(.*?)```", after, re.S)
    assert block is not None, "README.md: no ```bash block after <!-- quickstart -->"
    text = block.group(1).replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip()]


def test_readme_has_five_commands() -> None:
    commands = quickstart_commands((REPO_ROOT / "README.md").read_text())
    assert len(commands) == 5
    assert [c.endswith("&") for c in commands] == [True, True, True, False, False]


def ported_quickstart(ports: Mapping[str, str]) -> list[str]:
    """The quick start's commands with each of README's ``PORTS`` replaced by ``ports``'s."""
    pattern = re.compile(r"(?<![\d.])(" + "|".join(PORTS) + r")(?!\d)")
    return [
        pattern.sub(lambda m: ports[m.group(1)], c)
        for c in quickstart_commands((REPO_ROOT / "README.md").read_text())
    ]


@pytest.fixture
def background() -> Iterator[list[ManagedProcess]]:
    procs: list[ManagedProcess] = []
    try:
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def test_readme_quickstart_runs(tmp_path: Path, background: list[ManagedProcess]) -> None:
    mapping = {p: str(free_port()) for p in PORTS}
    commands = ported_quickstart(mapping)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    outputs = []
    for i, cmd in enumerate(commands):
        if cmd.endswith("&"):
            argv = ["bash", "-c", cmd[:-1]]
            log = tmp_path / f"cmd{i}.log"
            background.append(ManagedProcess(f"cmd{i}", argv, log, env=env, cwd=tmp_path).start())
            continue
        done = subprocess.run(
            ["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, timeout=300
        )
        logs = "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("cmd*.log"))
        assert done.returncode == 0, (cmd, done.stdout, done.stderr, logs)
        outputs.append(done.stdout.decode())
    assert all(p.returncode is None for p in background), "a background command exited"
    router = scrape(f"http://127.0.0.1:{mapping['8000']}")
    assert router.value("bidir_kv_router_cache_hits_total") > 0
    p2p = re.search(r'source="p2p"\} ([0-9.e+]+)', outputs[-1])
    assert p2p is not None and float(p2p.group(1)) > 0, outputs[-1]
