"""``bidir-kv campaign`` smoke: small load, a few faults and every bad input, bounded.

The full 256 x 10 run and every fault are measured by hand (docs/campaign.md); here
the command must start its topology, print the table, pass and stop everything.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bidir_kv.campaign.cli import main
from bidir_kv.testing.gating import skip_or_fail


@pytest.mark.timeout(180)
def test_campaign_smoke_memory_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "--conversations",
            "6",
            "--turns",
            "3",
            "--run-dir",
            str(tmp_path),
            "--faults",
            "p-restart",
            "client-gone",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    for part in ("LOAD", "FAULTS", "BAD INPUTS", "5xx or no answer: 0", "campaign: PASS"):
        assert part in out, out
    assert "FAIL" not in out.replace("campaign: PASS", ""), out


@pytest.mark.timeout(180)
def test_campaign_load_on_two_router_workers_sharing_redis(
    request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Turns of one conversation land on either worker; each finds the other's entry."""
    if shutil.which("redis-server") is None:
        skip_or_fail(request.config, "integration", "redis-server binary not found")
    rc = main(
        [
            "--conversations",
            "8",
            "--turns",
            "3",
            "--store",
            "redis",
            "--campaigns",
            "load",
            "--router-arg=--workers=2",
            "--run-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "campaign: PASS" in out, out


@pytest.mark.timeout(240)
def test_campaign_misbehaviour_rows_on_two_workers_and_redis(
    request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Slow clients, a killed router worker and a paused Redis: each a row that holds."""
    if shutil.which("redis-server") is None:
        skip_or_fail(request.config, "integration", "redis-server binary not found")
    rc = main(
        [
            "--store",
            "redis",
            "--campaigns",
            "faults",
            "--faults",
            "slow-clients",
            "worker-killed",
            "redis-paused",
            "--router-arg=--workers=2",
            "--run-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "campaign: PASS" in out, out
    for row in ("slow clients", "router worker killed", "Redis paused"):
        assert row in out, out
    assert "not tried" not in out, out
