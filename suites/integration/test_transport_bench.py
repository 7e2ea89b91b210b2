"""The transfer benchmark command runs end to end (tiny sizes; numbers are not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bidir_kv.testing.transports import require_nixl
from bidir_kv.tools.transport_bench import main


def test_bench_all_cases_small(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    require_nixl(request.config)
    out = tmp_path / "bench.json"
    rc = main(["--mib", "1", "--block-kib", "64", "--iters", "2", "--json", str(out)])
    table = capsys.readouterr().out
    assert rc == 0, table
    rows = {r["case"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"raw-nixl", "raw-tcp", "agent-nixl", "agent-tcp", "engine-d2p"}
    for name, r in rows.items():
        assert not r["error"], (name, r["error"])
        assert len(r["seconds"]) == 2 and r["nbytes"] == 1024 * 1024, name
    assert "median/raw" in table and "engine-d2p" in table


def test_bench_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--cases", "raw-nixl,warp-drive"])
    assert "unknown case(s): warp-drive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--mib", "3", "--block-kib", "2048"])
