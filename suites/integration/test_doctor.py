"""`bidir-kv doctor` against emulated pairs: a healthy pair exits 0, and each seeded
fault (the emulator's fault flags and settings) is named by the check that owns it."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bidir_kv.client import COMPLETIONS_PATH, fetch
from bidir_kv.doctor.checks import Context, Result
from bidir_kv.doctor.cli import run
from bidir_kv.testing.engines import EnginePair, random_prompt
from bidir_kv.testing.poll import wait_for
from bidir_kv.testing.router import start_router_process

TTL = 480.0


def _ctx(pair: EnginePair, router: str | None = None, ttl: float | None = TTL) -> Context:
    logs = {
        role: Path(str(c.node.log_path)) for role, c in (("prefill", pair.p), ("decode", pair.d))
    }
    return Context(
        prefill_url=pair.p.url,
        decode_url=pair.d.url,
        router_url=router,
        logs=logs,
        decoder_ttl=ttl,
        host_checks=False,
    )


def _by_name(results: list[Result]) -> dict[str, Result]:
    return {r.name.split(" (")[0].split(" /")[0]: r for r in results}


def _fails(results: list[Result]) -> dict[str, Result]:
    return {k: r for k, r in _by_name(results).items() if r.status == "FAIL"}


V33 = {"emulate_vllm": "0.33"}


def test_healthy_pair_exits_zero(engine_pair: Callable[..., EnginePair]) -> None:
    pair = engine_pair(prefill=V33, decode=V33)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bidir_kv",
            "doctor",
            "--prefill-url",
            pair.p.url,
            "--decode-url",
            pair.d.url,
            "--prefill-log",
            str(pair.p.node.log_path),
            "--decode-log",
            str(pair.d.node.log_path),
            "--decoder-kv-blocks-ttl",
            str(TTL),
            "--no-host-checks",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads(out.stdout)
    assert {r["status"] for r in results} <= {"PASS", "WARN"}
    probe = next(r for r in results if r["name"].startswith("live D->P read"))
    assert probe["status"] == "PASS" and "pulled" in probe["detail"]


def test_bidirectional_off_on_d(engine_pair: Callable[..., EnginePair]) -> None:
    pair = engine_pair(prefill=V33, decode=V33, decode_kv={"bidirectional_kv_xfer": False})
    fails = _fails(run(_ctx(pair)))
    assert "bidirectional on" in fails
    assert (
        "bidirectional_kv_xfer" in fails["bidirectional on"].detail + fails["bidirectional on"].fix
    )


def test_failed_transfers(engine_pair: Callable[..., EnginePair]) -> None:
    pair = engine_pair(
        prefill={**V33, "extra_args": ("--fault-fail-transfers", "1.0")},
        decode=V33,
        kv={"kv_load_failure_policy": "recompute"},
    )
    fails = _fails(run(_ctx(pair)))
    assert "failed transfers" in fails and "live D->P read" in fails
    assert "nixl_num_failed_transfers" in fails["failed transfers"].detail


def test_expired_reads(engine_pair: Callable[..., EnginePair]) -> None:
    # D keeps blocks 3 s; P declines a read 5 s before D's deadline: every turn 2 declines
    pair = engine_pair(
        prefill=V33,
        decode=V33,
        decode_kv={"decoder_kv_blocks_ttl": 3},
        kv={"kv_load_failure_policy": "recompute"},
    )
    fails = _fails(run(_ctx(pair, ttl=3.0)))
    assert "expired reads" in fails
    assert "decoder_kv_blocks_ttl" in fails["expired reads"].fix


def test_lapsed_p_lease_is_not_an_expired_read(engine_pair: Callable[..., EnginePair]) -> None:
    """A prefill whose D leg never comes: P frees its blocks at kv_lease_duration and
    counts it in the same counter as declined reads. That is a WARN naming the lease, not
    the "expired reads" FAIL that sends the operator to D's TTL."""
    pair = engine_pair(prefill=V33, decode=V33, prefill_kv={"kv_lease_duration": 6})
    pr = pair.prefill(random_prompt(random.Random("lapse"), 64), None)
    assert pr.ok and pr.params is not None
    wait_for(lambda: pair.state("p")["leased"] == 0, timeout=15)
    by_name = _by_name(run(_ctx(pair)))
    assert by_name["expired reads"].status != "FAIL", by_name["expired reads"]
    lapsed = by_name["P leases lapsed"]
    assert lapsed.status == "WARN" and "1 prefill" in lapsed.detail
    assert "kv_lease_duration" in lapsed.fix


def test_clock_skew(engine_pair: Callable[..., EnginePair]) -> None:
    pair = engine_pair(prefill=V33, decode={**V33, "extra_args": ("--fault-clock-skew", "30")})
    fails = _fails(run(_ctx(pair)))
    assert "clock offset P-D" in fails
    assert re.search(r"deadline is \+(29|30)\.\d s off", fails["clock offset P-D"].detail)


def test_version_skew(engine_pair: Callable[..., EnginePair]) -> None:
    pair = engine_pair(prefill={"emulate_vllm": "0.32"}, decode=V33)
    fails = _fails(run(_ctx(pair), probe=False))
    assert "NIXL compatibility" in fails
    assert "0.32.0" in fails["NIXL compatibility"].detail


def test_router_faults(engine_pair: Callable[..., EnginePair], run_dir: Path) -> None:
    """A 0.32 D (no params on streams) behind a router that streams from D, was told a
    wrong D TTL (900 s; D keeps 480 s) so its cache TTL is above D's, and whose clients
    send no conversation ids."""
    pair = engine_pair(prefill={"emulate_vllm": "0.32"}, decode={"emulate_vllm": "0.32"})
    p, d = pair.p.node, pair.d.node
    router = start_router_process(
        run_dir,
        [(p.host, p.port)],
        [(d.host, d.port)],
        ["--cache-ttl", "600", "--decoder-kv-blocks-ttl", "900", "--decode-stream", "always"],
        timeout=60,
    )
    try:
        fetch(
            router.url + COMPLETIONS_PATH,
            method="POST",
            json={"model": "tiny", "prompt": "hello there", "max_tokens": 4},
            timeout=60,
        ).raise_for_status()
        fails = _fails(run(_ctx(pair, router=router.url)))
    finally:
        router.proc.stop()
    assert "D returns params on streams" in fails
    assert "--decode-stream never" in fails["D returns params on streams"].fix
    assert "router cache TTL below D's TTL" in fails
    assert "600" in fails["router cache TTL below D's TTL"].detail
    assert "router receives conversation ids" in fails


@pytest.mark.parametrize("flag", ["--no-probe"])
def test_unreachable_node_fails_first(tmp_path: Path, flag: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bidir_kv",
            "doctor",
            "--prefill-url",
            "http://127.0.0.1:9",
            "--decode-url",
            "http://127.0.0.1:9",
            flag,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1
    assert "FAIL" in out.stdout and "/health answered nothing" in out.stdout


def test_retained_share_above_the_bound_warns(engine_pair: Callable[..., EnginePair]) -> None:
    """Four retained 200-token turns hold 52 of D's 64 blocks (81 %): above the default
    half it is a WARN naming the share and the budget; a higher bound passes it."""
    pair = engine_pair(prefill=V33, decode={**V33, "kv_capacity_tokens": 1024})
    rng = random.Random("retained-share")
    for _ in range(4):
        _, d = pair.turn(random_prompt(rng, 200), 8)
        assert d is not None
        d.raise_for_status()
    check = _by_name(run(_ctx(pair), probe=False))["D's KV held by retained turns"]
    assert check.status == "WARN", check
    assert check.detail.startswith("81% of D's KV blocks (bidir_kv:kv_cache_retained_perc)")
    assert "bidir_kv_retention_budget" in check.fix
    ctx = _ctx(pair)
    ctx.max_retained_share = 0.9
    relaxed = _by_name(run(ctx, probe=False))["D's KV held by retained turns"]
    assert relaxed.status == "PASS" and "bound 90%" in relaxed.detail
