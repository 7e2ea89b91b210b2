"""Tier gating: skip a test whose infrastructure is missing, or fail it when its tier is
required (``--require-tier`` / ``BIDIR_KV_REQUIRE``, as CI sets it).

A leaf module (pytest and the standard library only) so that every fixture module and
suite can import it without importing the plugin that registers the fixtures.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

__all__ = ["REQUIRE_ENV", "required_tiers", "skip_or_fail"]

REQUIRE_ENV = "BIDIR_KV_REQUIRE"  # comma-separated tiers that must run here


def required_tiers(config: pytest.Config) -> set[str]:
    """Tiers that must not be skipped: ``--require-tier`` plus ``$BIDIR_KV_REQUIRE``."""
    env = os.environ.get(REQUIRE_ENV, "")
    return {t.strip() for t in env.split(",") if t.strip()} | set(
        config.getoption("--require-tier")
    )


def skip_or_fail(config: pytest.Config, tier: str, reason: str) -> NoReturn:
    """Missing infrastructure: skip with ``reason``, or fail when the tier is required."""
    if tier in required_tiers(config):
        pytest.fail(f"{tier} tier is required here but cannot run: {reason}", pytrace=False)
    pytest.skip(reason)
