"""LocalTopology end to end (engines + `bidir-kv proxy`), heartbeats, the metrics log line,
and engines started with the realistic cost profiles."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.client import CHAT_PATH, fetch, scrape
from bidir_kv.engine.model import WORDS
from bidir_kv.engine.profiles import available_profiles
from bidir_kv.testing.engines import EnginePair, kv_config, random_prompt
from bidir_kv.testing.poll import wait_for
from bidir_kv.topology.base import EngineSpec, RouterSpec, TopologySpec
from bidir_kv.topology.local import LocalTopology

Factory = Callable[..., EnginePair]
EXTERNAL = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})


def chat(url: str, body: dict[str, Any]) -> dict[str, Any]:
    return (
        fetch(url + CHAT_PATH, method="POST", json=body, timeout=60)
        .raise_for_status()
        .json_object()
    )


def test_local_topology_with_router_reuses_kv_across_turns(tmp_path: Path) -> None:
    pytest.importorskip("bidir_kv.router.cli")
    spec = TopologySpec(
        prefill=EngineSpec(kv=kv_config("prefill"), enable_prefix_caching=False),
        decode=EngineSpec(kv=kv_config("decode")),
        routers=1,
        router=RouterSpec(cache_ttl=60),
    )
    with LocalTopology(spec, tmp_path) as topo:
        assert set(topo.startup_seconds) == {"prefill-0", "decode-0", "router-0"}
        rng = random.Random("router")
        msgs = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=200))}]
        p = topo.prefill[0].url
        before = scrape(p)
        first = chat(
            topo.router_url,
            {"messages": msgs, "max_tokens": 8, "ignore_eos": True, "conversation_id": "c1"},
        )
        answer = first["choices"][0]["message"]["content"]
        msgs += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": " ".join(rng.choices(WORDS, k=30))},
        ]
        mid = scrape(p)
        assert (mid - before).value(EXTERNAL[0], **EXTERNAL[1]) == 0  # turn 1: a miss
        chat(
            topo.router_url,
            {"messages": msgs, "max_tokens": 8, "ignore_eos": True, "conversation_id": "c1"},
        )
        pulled = (scrape(p) - mid).value(EXTERNAL[0], **EXTERNAL[1])
        assert pulled > 64  # turn 2: P read D's retained history


def test_heartbeats_extend_p_lease_while_d_reads(engine_pair: Factory) -> None:
    """D heartbeats P (`HB:<id>`) every kv_lease_duration // 6 s while its read is in flight."""
    pair = engine_pair(
        prefill={"env": (("VLLM_LOGGING_LEVEL", "DEBUG"),)}, kv={"kv_lease_duration": 6}
    )
    pair.set_faults("d", delay_transfers=1.0, delay_seconds=2.5)
    prompt = random_prompt(random.Random("hb"), 64)
    mark = pair.p.log_mark()
    pr, dr = pair.turn(prompt, 2)
    assert dr is not None and dr.ok and pr.params is not None
    assert f"Heartbeat extended lease for request {pr.params.remote_request_id} by 4s" in (
        pair.p.log_since(mark)
    )


def test_kv_transfer_metrics_line(engine_pair: Factory) -> None:
    pair = engine_pair(decode={"extra_args": ("--kv-metrics-log-interval", "0.2")})
    mark = pair.d.log_mark()
    pair.turn(random_prompt(random.Random("kvline"), 100), 2)
    line = wait_for(
        lambda: next(
            (
                ln
                for ln in (pair.d.log_since(mark) or "").splitlines()
                if "KV Transfer metrics: " in ln
            ),
            None,
        )
    )
    keys = [kv.split("=")[0] for kv in line.split("KV Transfer metrics: ", 1)[1].split(", ")]
    assert keys == [
        "Num successful transfers",
        "Avg xfer time (ms)",
        "P90 xfer time (ms)",
        "Avg post time (ms)",
        "P90 post time (ms)",
        "Avg MB per transfer",
        "Throughput (MB/s)",
        "Avg number of descriptors",
        "Num failed transfers",
        "Num KV expired reqs",
        "Num notifs after expiry",
    ]
    assert "Num successful transfers=1," in line


@pytest.mark.parametrize("profile", [p for p in available_profiles() if p != "tiny"])
def test_realistic_profiles_serve_the_protocol(engine_pair: Factory, profile: str) -> None:
    """A profile changes durations only: params and the oracle are unaffected."""
    pair = engine_pair(prefill={"profile": profile}, decode={"profile": profile})
    rng = random.Random(profile)
    prompt = random_prompt(rng, 300)
    _, d1 = pair.turn(prompt, 4)
    assert d1 is not None and d1.ok and d1.params is not None
    assert d1.token_ids == pair.d.complete(prompt, 4).token_ids
