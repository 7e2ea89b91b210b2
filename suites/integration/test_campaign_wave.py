"""``bidir-kv campaign wave`` on the emulator, small: each variant releases what it should.

A wave of six 2,000-token turns on a D of 8,192 tokens, with TTL 6 s. Without a budget D
releases fenced turns under pressure only; with a budget, for the budget; the control
(the emulator's vLLM mode) releases nothing early, only at the TTL. Times are printed,
never asserted (docs/campaign.md "The D-full wave").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bidir_kv.campaign.cli import main


@pytest.mark.timeout(300)
def test_wave_variants_release_as_configured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big_turns, continuing = 6, 2
    rc = main(
        [
            "wave",
            "--capacity-tokens",
            "8192",
            "--big-turns",
            str(big_turns),
            "--big-tokens",
            "2000",
            "--continuing",
            str(continuing),
            "--ttl",
            "6",
            "--run-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| | pressure | budget | stock |" in out, out
    got = {v["name"]: v for v in json.loads((tmp_path / "wave.json").read_text())["variants"]}
    for name, v in got.items():
        assert v["error"] is None, (name, v["error"])
        w = v["wave"]
        assert all(t["status"] == 200 for t in w["big"]), (name, w["big"])
        assert len(w["probes"]) == big_turns + 3, name  # one per big turn, three after
        assert len(w["continued"]) == big_turns + continuing, name
        assert not any(t["correct"] is False for t, _ in w["continued"]), name
    rel = {name: v["wave"]["releases"] for name, v in got.items()}
    assert rel["pressure"]["pressure"] > 0 and rel["pressure"]["budget"] == 0, rel
    assert rel["budget"]["budget"] > 0, rel
    assert rel["stock"]["budget"] == rel["stock"]["pressure"] == 0, rel
    assert rel["stock"]["ttl"] > 0, rel  # what frees the control's D: the TTL
