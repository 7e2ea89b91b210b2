"""1P1D + router in Docker containers: a multi-turn conversation with a real D->P pull
over the container network, and faults (a cut P->D link, a killed D) through the router.

P runs with prefix caching off (the AWS blog's setting, docs/protocol.md §13.2), so on turn 2
everything D retained must come from D (``external_kv_transfer`` on P, bytes moved,
telemetry on P as the initiator, docs/protocol.md §11.1) or be recomputed. Each turn's answer is
compared with the same conversation served without reuse: the emulated model is
deterministic, so pulled KV that belonged to other tokens would change the text.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from bidir_kv.client import scrape, settled_metrics
from bidir_kv.scrape import MetricsSnapshot
from bidir_kv.testing.faults import cut_link, kill_container
from bidir_kv.testing.gating import skip_or_fail
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.testing.poll import wait_for
from bidir_kv.testing.router import bidirectional_config, chat
from bidir_kv.topology.base import EngineSpec, Node, RouterSpec, TopologySpec
from bidir_kv.topology.container import HTTP_PORT, ContainerTopology
from bidir_kv.topology.container_manifest import IMAGE_PYTHON

TOKENS = "vllm:prompt_tokens_by_source_total"
BYTES = "vllm:nixl_bytes_transferred_sum"
XFERS = "vllm:nixl_xfer_time_seconds_count"
FAILED = "vllm:nixl_num_failed_transfers_total"
FALLBACKS = "bidir_kv_router_fallbacks_total"
HITS = "bidir_kv_router_cache_hits_total"  # turns whose tokens P pulled
OFFERS = "bidir_kv_router_cache_hit_offers_total"  # turns sent to P with D's dict
MISSES = "bidir_kv_router_cache_misses_total"
HEALTHY = "bidir_kv_router_backend_healthy"

Factory = Callable[..., ContainerTopology]


def _spec(num_decode: int = 1, health_interval: float = 0.5) -> TopologySpec:
    return TopologySpec(
        num_prefill=1,
        num_decode=num_decode,
        prefill=EngineSpec(kv=bidirectional_config("prefill"), enable_prefix_caching=False),
        decode=EngineSpec(kv=bidirectional_config("decode")),
        router=RouterSpec(extra_args=("--health-interval", str(health_interval))),
    )


def _opening(tag: str) -> list[dict[str, Any]]:
    # ~300 tokens, far above the 64-token recompute threshold
    return [{"role": "user", "content": f"{tag}: the harbour log of a long voyage. " * 30}]


def _next(msgs: list[dict[str, Any]], answer: str, n: int) -> list[dict[str, Any]]:
    return [
        *msgs,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": f"Continue with chapter {n}, please."},
    ]


def _delta(node: Node, before: MetricsSnapshot) -> MetricsSnapshot:
    """Engine metrics now minus ``before``, once the engine's counters stopped moving."""
    return settled_metrics(EngineClient(node)) - before


def _reference(url: str, turns: list[list[dict[str, Any]]]) -> list[str]:
    """Answers with no conversation id: every turn is a miss, nothing is reused."""
    out = []
    for msgs in turns:
        res = chat(url, msgs, None)
        assert res.status == 200, res.raw
        out.append(res.text)
    return out


def test_multiturn_conversation_pulls_history_from_d_across_containers(
    container_topology: Factory,
) -> None:
    topo = container_topology(_spec())
    p, d = topo.prefill[0], topo.decode[0]
    url = topo.router_url

    msgs = _opening("pd")
    t1 = chat(url, msgs, "conv-pd")
    assert t1.status == 200 and t1.text

    answers = [t1.text]
    history = [msgs]
    for n in (2, 3):
        msgs = _next(msgs, answers[-1], n)
        history.append(msgs)
        p0, d0, r0 = scrape(p.url), scrape(d.url), scrape(url)
        res = chat(url, msgs, "conv-pd")
        assert res.status == 200, res.raw
        answers.append(res.text)
        dp, dr = _delta(p, p0), scrape(url) - r0
        # the router sent D's params to P, and P read D's retained blocks over the network
        assert dr.value(HITS) == 1
        assert dr.value(FALLBACKS) == 0
        pulled = dp.value(TOKENS, source="external_kv_transfer")
        assert pulled >= 64, f"turn {n}: P pulled {pulled} tokens (threshold 64)"
        assert dp.value(TOKENS, source="local_cache_hit") == 0  # P's prefix cache is off
        assert dp.value(XFERS) >= 1 and dp.value(BYTES) > 0  # initiator records telemetry
        assert dp.value(FAILED) == 0
        # D served the turn and still had most of the history in its own prefix cache
        dd = _delta(d, d0)
        assert dd.value(TOKENS, source="local_cache_hit") > 0

    assert _reference(url, history) == answers


def test_cut_p_to_d_link_falls_back_to_recompute_with_the_same_answer(
    container_topology: Factory, request: pytest.FixtureRequest
) -> None:
    if os.geteuid() != 0:
        skip_or_fail(request.config, "integration", "cutting a link needs root (nsenter, iptables)")
    topo = container_topology(_spec())
    p, d = topo.prefill[0], topo.decode[0]
    url = topo.router_url

    msgs = _opening("cut")
    t1 = chat(url, msgs, "conv-cut")
    assert t1.status == 200
    msgs2 = _next(msgs, t1.text, 2)

    # P can no longer open (or use) connections to D; D still reaches P and the router.
    # Checked: a connection from P's container to D fails while cut, works once healed.
    with cut_link(
        f"{p.name} -> {d.name}",
        lambda: topo.block_outbound(p.name, d.name),
        topo.unblock_all,
        lambda: _reaches(topo, p.name, d.name),
    ):
        p0, r0 = scrape(p.url), scrape(url)
        t2 = chat(url, msgs2, "conv-cut")
        assert t2.status == 200, t2.raw
        dp, dr = _delta(p, p0), scrape(url) - r0
        assert dr.value(OFFERS) == 1  # the router did try reuse ...
        assert dr.value(HITS) == 0  # ... which pulled nothing, so it is no hit
        assert dr.value(FALLBACKS) >= 1  # ... P failed the read, the router retried as a miss
        assert dp.value(FAILED) >= 1
        assert dp.value(TOKENS, source="external_kv_transfer") == 0
        assert dp.value(TOKENS, source="local_compute") > 0

    # the link heals: the next turn pulls again
    msgs3 = _next(msgs2, t2.text, 3)
    p1 = scrape(p.url)
    t3 = chat(url, msgs3, "conv-cut")
    assert t3.status == 200, t3.raw
    assert _delta(p, p1).value(TOKENS, source="external_kv_transfer") >= 64

    assert _reference(url, [msgs, msgs2, msgs3]) == [t1.text, t2.text, t3.text]


@pytest.mark.parametrize("noticed", [True, False], ids=["router-noticed", "router-unaware"])
def test_killed_decode_container_conversation_continues_on_the_other_d(
    container_topology: Factory, noticed: bool
) -> None:
    """D holding the conversation is SIGKILLed between turns (its retained KV is gone).

    router-noticed: health checks mark it down first; the router treats the turn as a
    miss without trying reuse. router-unaware (health checks effectively off): the
    router sends D's params to P, P's read fails, the router retries as a miss and
    moves the D leg to the surviving D. Either way the client sees a normal answer.
    """
    topo = container_topology(_spec(num_decode=2, health_interval=0.5 if noticed else 3600))
    p = topo.prefill[0]
    url = topo.router_url

    msgs = _opening("kill")
    before = [scrape(n.url) for n in topo.decode]
    t1 = chat(url, msgs, "conv-kill")
    assert t1.status == 200
    served = [n for n, b in zip(topo.decode, before, strict=True) if _delta(n, b).value(TOKENS) > 0]
    assert len(served) == 1
    home = served[0]
    other = next(n for n in topo.decode if n is not home)

    kill_container(topo, home.name)  # SIGKILL, checked: D's retained blocks are gone with it
    if noticed:
        _wait_health(url, "decode", f"{home.name}:8000", up=False)

    msgs2 = _next(msgs, t1.text, 2)
    p0, o0, r0 = scrape(p.url), scrape(other.url), scrape(url)
    t2 = chat(url, msgs2, "conv-kill")
    assert t2.status == 200, t2.raw
    dp, do, dr = _delta(p, p0), _delta(other, o0), scrape(url) - r0
    if noticed:
        assert dr.value(MISSES, reason="holder_down") == 1
        assert dr.value(FALLBACKS) == 0
        assert dp.value(FAILED) == 0  # P was never asked to read from the dead D
    else:
        assert dr.value(OFFERS) == 1
        assert dr.value(HITS) == 0  # the read failed: not counted as a hit
        assert dr.value(FALLBACKS) >= 1
        assert dp.value(FAILED) >= 1
    assert dp.value(TOKENS, source="external_kv_transfer") == 0  # nothing left to pull
    assert do.value(TOKENS) > 0  # the surviving D served the turn
    assert _reference(url, [msgs, msgs2]) == [t1.text, t2.text]


def _reaches(topo: ContainerTopology, src: str, dst: str) -> bool:
    """Whether a TCP connection from ``src``'s container to ``dst``'s HTTP port opens."""
    code, _ = topo.container(src).exec_run(
        [
            IMAGE_PYTHON,
            "-c",
            "import socket, sys; socket.create_connection("
            "(sys.argv[1], int(sys.argv[2])), timeout=2).close()",
            dst,
            str(HTTP_PORT),
        ]
    )
    return bool(code == 0)


def _wait_health(router_url: str, role: str, node: str, up: bool, timeout: float = 30.0) -> None:
    """Poll the router's health gauge until it reports ``node`` up (1) or down (0)."""
    want = 1.0 if up else 0.0
    key = (HEALTHY, (("node", node), ("role", role)))
    wait_for(
        lambda: scrape(router_url).samples.get(key) == want,
        timeout,
        f"the router to mark {role} {node} {'up' if up else 'down'}",
        interval=0.1,
    )


def test_prefill_pulled_off_the_network_and_back(container_topology: Factory) -> None:
    """Router<->P link cut (P detached from the network), then restored.

    While P is unreachable the router answers 503 naming the prefill node instead of
    hanging; after P rejoins under the same name, the conversation goes on and the
    answers are still the ones computed without any reuse.
    """
    topo = container_topology(_spec())
    p = topo.prefill[0]
    url = topo.router_url
    p_id = f"{p.name}:8000"

    msgs = _opening("net")
    t1 = chat(url, msgs, "conv-net")
    assert t1.status == 200
    msgs2 = _next(msgs, t1.text, 2)

    # checked: the router's container cannot connect to P while P is off, and can after
    with cut_link(
        f"the network to {p.name}",
        lambda: topo.disconnect(p.name),
        lambda: topo.reconnect(p.name),
        lambda: _reaches(topo, topo.routers[0].name, p.name),
    ):
        _wait_health(url, "prefill", p_id, up=False)
        down = chat(url, msgs2, "conv-net", timeout=30)
        assert down.status == 503
        assert p.name in str(down.error)

    _wait_health(url, "prefill", p_id, up=True)
    t2 = chat(url, msgs2, "conv-net")
    assert t2.status == 200, t2.raw
    assert _reference(url, [msgs, msgs2]) == [t1.text, t2.text]
