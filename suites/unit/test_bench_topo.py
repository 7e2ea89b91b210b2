"""The OFF and ON legs differ only in bidirectional_kv_xfer; P never prefix-caches."""

from __future__ import annotations

import dataclasses

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
