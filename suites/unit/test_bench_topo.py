"""The OFF and ON legs differ only in bidirectional_kv_xfer; P prefix-caches only when asked."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bidir_kv.bench.topo import LegSetup, leg_spec, router_cache_ttl


def test_legs_differ_only_in_the_switch() -> None:
    setup = LegSetup(
        profile="qwen3-32b-p5en",
        kv_recompute_threshold=80,
        decoder_kv_blocks_ttl=120.0,
        transport="tcp",
    )
    off, on = leg_spec("off", setup), leg_spec("on", setup)
    for spec, flag in ((off, False), (on, True)):
        assert spec.prefill.kv.bidirectional_kv_xfer is flag
        assert spec.decode.kv.bidirectional_kv_xfer is flag
        assert spec.prefill.enable_prefix_caching is False  # as in the AWS blog
        assert spec.decode.enable_prefix_caching is True
        assert spec.prefill.kv.kv_recompute_threshold == 80
        assert spec.decode.kv.decoder_kv_blocks_ttl == 120.0
        assert spec.prefill.profile == spec.decode.profile == "qwen3-32b-p5en"
        assert spec.prefill.transport == "tcp"
        assert spec.router.cache_ttl < 120.0
    strip = lambda e: dataclasses.replace(e, kv=None)  # noqa: E731
    assert strip(off.prefill) == strip(on.prefill) and strip(off.decode) == strip(on.decode)
    with pytest.raises(ValueError):
        leg_spec("both", setup)


def test_router_cache_ttl_stays_below_d() -> None:
    assert router_cache_ttl(480) == 450  # the upstream proxy's pair
    assert router_cache_ttl(10) < 10
    assert router_cache_ttl(10_000) == 450


def test_per_role_engine_flags_p_cache_and_budget_reach_only_their_node() -> None:
    """``--prefill-engine-arg``/``--decode-engine-arg`` go to one role, ``--engine-arg``
    to both; ``--prefill-prefix-caching`` turns P's cache on; the retention budget is
    D's config key, in both legs (OFF retains nothing, so it changes nothing there)."""
    from bidir_kv.bench.cli import build_parser
    from bidir_kv.bench.sweep import _leg_setup
    from bidir_kv.wire.fence import BUDGET_CONFIG_KEY

    args = build_parser().parse_args(
        [
            "--engine-arg=--no-kv-verify",
            "--prefill-engine-arg=--kv-capacity-tokens=4096",
            "--decode-engine-arg=--retained-blocks=pin",
            "--prefill-prefix-caching",
            "--retention-budget",
            "0.4",
        ]
    )
    setup = _leg_setup(args, Path("out"))
    for leg in ("off", "on"):
        spec = leg_spec(leg, setup)
        assert spec.prefill.extra_args == ("--no-kv-verify", "--kv-capacity-tokens=4096")
        assert spec.decode.extra_args == ("--no-kv-verify", "--retained-blocks=pin")
        assert spec.prefill.enable_prefix_caching and spec.decode.enable_prefix_caching
        assert spec.decode.kv.extra[BUDGET_CONFIG_KEY] == 0.4
        assert BUDGET_CONFIG_KEY not in spec.prefill.kv.extra
    default = leg_spec("on", _leg_setup(build_parser().parse_args([]), Path("out")))
    assert not default.prefill.enable_prefix_caching  # the publication's cold P
    assert BUDGET_CONFIG_KEY not in default.decode.kv.extra
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--retention-budget", bad])
