"""``POST /drop_peer`` (vLLM PR #56341) on the emulated engine, and the router calling it
when its health probe sees a node die (docs/router.md "Dead peers")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.client import fetch, scrape
from bidir_kv.testing.faults import confirm_faults, restart_node, stop_process
from bidir_kv.testing.poll import wait_for
from bidir_kv.testing.router import (
    chat,
    conversation_id,
    emulated_router_topology,
    long_opening,
    router_counter,
)

DROPS = "bidir_kv:drop_peer_requests_total"


@pytest.fixture
def topo(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    with emulated_router_topology(request.config, tmp_path, prefix_caching_on_p=False) as t:
        yield t


def post(url: str, path: str, body: Any) -> tuple[int, Any]:
    reply = fetch(url + path, method="POST", json=body, timeout=10)
    return reply.status, reply.json()


def engine_id(node: Any) -> str:
    return str(node.info["engine_id"])


def test_the_emulator_frees_what_a_dropped_reader_claimed(topo: Any) -> None:
    p, d = topo.prefill[0], topo.decode[0]
    assert post(d.url, "/drop_peer", {})[0] == 400
    status, answer = post(d.url, "/drop_peer", {"engine_id": "nobody"})
    assert status == 200
    assert answer == {"engine_id": "nobody", "aborted": 0, "freed_blocks": 0, "peers_dropped": 0}
    # P ignores D's "read done" notification: the blocks D claimed stay leased on P
    confirm_faults(
        p.name,
        {"drop_notifications": 1.0},
        post(p.url, "/_emulator/faults", {"drop_notifications": 1.0})[1],
    )
    conv = conversation_id("drop")
    assert chat(topo.router_url, long_opening(conv), conv).status == 200
    status, answer = post(p.url, "/drop_peer", {"engine_id": engine_id(d)})
    assert status == 200 and answer["freed_blocks"] > 0, answer
    # D handshook with P to pull: dropping P forgets that handshake
    status, answer = post(d.url, "/drop_peer", {"engine_id": engine_id(p)})
    assert status == 200 and answer["peers_dropped"] == 1, answer
    post(p.url, "/_emulator/faults", {"drop_notifications": 0.0})
    # the next turn handshakes again and reuses as before
    msgs = [
        *long_opening(conv),
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "more"},
    ]
    assert chat(topo.router_url, msgs, conv).status == 200
    assert scrape(d.url).value(DROPS) == 2


def test_the_router_tells_d_when_its_probe_sees_p_die(topo: Any) -> None:
    p, d, url = topo.prefill[0], topo.decode[0], topo.router_url
    conv = conversation_id("die")
    assert chat(url, long_opening(conv), conv).status == 200  # the router learns engine ids
    stop_process(topo.process(p.name))  # checked: P's process (and its group) is gone
    wait_for(
        lambda: router_counter(url, "drop_peer", outcome="sent") == 1,
        15,
        "the router to call D's /drop_peer",
    )
    assert scrape(d.url).value(DROPS) == 1
    log = Path(str(d.log_path)).read_text()
    assert f"drop_peer {engine_id(p)}: " in log and "'peers_dropped': 1" in log, log[-2000:]
    restart_node(topo, p)  # same engine id: nothing more to announce; a new pid serves
    wait_for(lambda: chat(url, long_opening(conv), conv).status == 200, 15, "P back")
    assert router_counter(url, "drop_peer", outcome="sent") == 1
