"""What goes into the registry-less container image (no Docker needed for these)."""

from __future__ import annotations

import os
from pathlib import Path

from bidir_kv.paths import REPO_ROOT
from bidir_kv.topology import container_image as ci
from bidir_kv.topology import container_manifest as manifest


def test_runtime_closure_has_runtime_deps_and_no_dev_tools() -> None:
    # a missing optional extra is skipped, not an error
    dists = manifest.runtime_distributions(extras=("no-such-dist-xyz",))
    names = {str(d.metadata["Name"]).lower().replace("_", "-") for d in dists}
    assert {"aiohttp", "numpy", "msgpack", "prometheus-client", "rich"} <= names
    assert {"multidict", "yarl"} <= names  # transitive requirements of aiohttp
    assert not names & {"pytest", "hypothesis", "testcontainers", "mypy", "ruff", "bidir-kv"}


def test_stdlib_selection_skips_tests_gui_and_optimised_bytecode() -> None:
    _, stdlib = manifest.host_python()
    files = [p.relative_to(stdlib) for p in manifest.stdlib_files(stdlib)]
    names = {str(p) for p in files}
    assert "os.py" in names and "asyncio/events.py" in names
    assert any(p.parts[0] == "lib-dynload" and p.name.startswith("_json") for p in files)
    assert not any(set(p.parts) & {"test", "tests", "tkinter", "site-packages"} for p in files)
    assert not any(p.name.endswith((".opt-1.pyc", ".opt-2.pyc")) for p in files)
    assert not any(p.parts[0] == "lib-dynload" and p.name.startswith("_tkinter") for p in files)


def test_link_chain_ends_in_a_real_file_without_symlinked_directories() -> None:
    exe, _ = manifest.host_python()
    for start in (Path("/lib64/ld-linux-x86-64.so.2"), exe):
        if not start.exists():
            continue
        chain = manifest.link_chain(start)
        last, target = chain[-1]
        assert target is None and last.is_file() and not last.is_symlink()
        for path, _ in chain:
            assert os.path.realpath(path.parent) == str(path.parent)
        assert os.path.realpath(start) == str(last)


def test_app_files_are_sources_only() -> None:
    files = dict(ci._app_files(REPO_ROOT))
    assert "bidir_kv/__init__.py" in files
    assert "bidir_kv/topology/container_image.py" in files
    assert not any("__pycache__" in rel or rel.endswith(".pyc") for rel in files)
    assert all(rel.split("/")[0] in ("bidir_kv", "fixtures") for rel in files)


def test_docker_created_timestamps_parse() -> None:
    assert ci._created_epoch("1970-01-01T00:01:40.123456789Z") == 100.0
    assert ci._created_epoch("1970-01-01T02:00:00+02:00") == 0.0
    assert ci._created_epoch("") is None
    assert ci._created_epoch("yesterday") is None
