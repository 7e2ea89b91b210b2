"""``bidir-kv proxy`` flag validation (upstream-compatible flags plus ours)."""

from __future__ import annotations

import pytest

from bidir_kv.router.cli import build_parser, main, settings_from_args
from bidir_kv.router.settings import RouterSettings


def settings(*argv: str) -> RouterSettings:
    return settings_from_args(build_parser().parse_args(list(argv)))


def test_upstream_flags_and_defaults() -> None:
    s = settings(
        "--prefiller-host",
        "p1",
        "p2",
        "--prefiller-port",
        "8100",
        "8101",
        "--decoder-hosts",
        "d1",
        "--decoder-ports",
        "8200",
    )
    assert s.prefill_hosts == ("p1", "p2") and s.prefill_ports == (8100, 8101)
    assert s.decode_hosts == ("d1",) and s.decode_ports == (8200,)
    assert s.cache_ttl == 450 and s.decode_stream == "always"
    assert s.guard and not s.keep_kv_params and s.store == "memory"
    d = settings()
    assert d.prefill_hosts == ("localhost",) and d.prefill_ports == (8100,)
    assert d.decode_ports == (8200,)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefiller-hosts", "a", "b", "--prefiller-ports", "1"], "--prefiller-hosts has 2"),
        (["--decoder-hosts", "a", "--decoder-ports", "1", "2"], "--decoder-hosts has 1"),
        (["--cache-ttl", "480"], "must be below --decoder-kv-blocks-ttl"),
        (["--cache-ttl", "100", "--decoder-kv-blocks-ttl", "60"], "(100s) must be below"),
        (["--cache-ttl", "0"], "--cache-ttl must be positive"),
        (["--store", "mysql://x"], "--store must be 'memory' or a redis:// URL"),
        (["--max-conversations", "0"], "--max-conversations must be positive"),
        (["--block-size", "-1"], "--block-size must be positive"),
        (["--workers", "2"], "--workers 2 needs a shared store"),
        (["--workers", "0"], "--workers must be positive"),
        (["--held-weight", "-1"], "--held-weight must be >= 0"),
        (["--release-concurrency", "0"], "--release-concurrency must be positive"),
        (["--max-pending-releases", "-1"], "--max-pending-releases must be >= 0"),
        (["--conversation-lease", "0"], "--conversation-lease must be a positive number"),
        (["--conversation-lease", "inf"], "--conversation-lease must be a positive number"),
        (["--lease-sweep-interval", "-1"], "--lease-sweep-interval must be >= 0"),
    ],
)
def test_bad_combinations_are_refused_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_decode_stream_choices() -> None:
    assert settings("--decode-stream", "never").decode_stream == "never"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--decode-stream", "sometimes"])


def test_placement_and_release_bounds_are_flags_defaulting_to_the_settings() -> None:
    d, r = settings(), RouterSettings()
    assert (d.held_weight, d.release_concurrency, d.max_pending_releases, d.workers) == (
        r.held_weight,
        r.release_concurrency,
        r.max_pending_releases,
        r.workers,
    )
    s = settings(
        "--held-weight",
        "0.5",
        "--release-concurrency",
        "8",
        "--max-pending-releases",
        "16",
        "--workers",
        "3",
        "--store",
        "redis://h:1/0",
    )
    assert (s.held_weight, s.release_concurrency, s.max_pending_releases, s.workers) == (
        0.5,
        8,
        16,
        3,
    )


def test_lease_flags_default_to_the_settings() -> None:
    d, r = settings(), RouterSettings()
    assert (
        (d.conversation_lease, d.lease_sweep_interval)
        == (r.conversation_lease, r.lease_sweep_interval)
        == (None, 0.5)
    )
    s = settings("--conversation-lease", "30", "--lease-sweep-interval", "0")
    assert (s.conversation_lease, s.lease_sweep_interval) == (30.0, 0.0)
