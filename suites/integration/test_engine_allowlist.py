"""P reads only from its peers: the peer allowlist and bad params (docs/connector.md §7).

Real ``bidir-kv engine`` processes on loopback. A listener on another loopback address
(127.0.0.2) stands in for a host outside the deployment: with the allowlist set it must
see no connection, and the request is still answered (no 5xx). A topology sets the
allowlist itself (``TopologySpec.peer_allowlist``, on by default): its own peers.
"""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.client import fetch
from bidir_kv.protocol import KVTransferParams
from bidir_kv.testing.engines import EnginePair, random_prompt, sources

Factory = Callable[..., EnginePair]
REFUSED = "bidir_kv:peer_refused_reqs_total"
ALLOW = {"bidir_kv_peer_allowlist": ["127.0.0.1/32"]}


class Listener:
    """Accepts on 127.0.0.2 and counts connections (closing each at once)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.2", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = int(self.sock.getsockname()[1])
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def outsider() -> Iterator[Listener]:
    lst = Listener()
    try:
        yield lst
    finally:
        lst.close()


def _foreign_d_params(port: int, **over: Any) -> KVTransferParams:
    fields: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_block_ids": [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]],
        "remote_engine_id": "somebody-else",
        "remote_request_id": "cmpl-x-0",
        "remote_host": "127.0.0.2",
        "remote_port": port,
        "remote_num_tokens": 190,
        "tp_size": 1,
        "transfer_mode": "pull",
    }
    fields.update(over)
    return KVTransferParams.build(**fields)


def _log(pair: EnginePair, which: str) -> str:
    node = pair.topo.prefill[0] if which == "p" else pair.topo.decode[0]
    return Path(node.log_path).read_text(errors="replace")


def test_params_naming_a_host_outside_the_allowlist_open_no_connection(
    engine_pair: Factory, outsider: Listener
) -> None:
    pair = engine_pair(kv=ALLOW)
    prompt = random_prompt(random.Random("outsider"), 200)
    p0, _ = pair.snap()
    for _ in range(2):
        r = pair.p.complete(prompt, 1, _foreign_d_params(outsider.port))
        assert r.ok, (r.status, r.error)  # answered, no 5xx
    assert outsider.accepted == 0
    assert (pair.p.metrics() - p0).value(REFUSED) == 2
    log = _log(pair, "p")
    assert log.count("Peer allowlist: request") == 1  # logged once per peer
    assert "Peer allowlist: KV is read only from 127.0.0.1/32" in log
    # the deployment's own D is inside the allowlist: turns still read its history
    _, d1 = pair.turn(prompt, 8)
    assert d1 is not None and d1.ok and d1.params is not None
    pr, _ = pair.turn([*prompt, *d1.token_ids, 5, 6, 7], 8, d1.params)
    assert pr.ok and (pair.p.metrics() - p0).value(REFUSED) == 2


def test_a_topology_pair_reads_only_from_its_own_peers_by_default(
    engine_pair: Factory, outsider: Listener
) -> None:
    """No allowlist given: the topology lists each node's peers by their address
    (127.0.0.1). Params naming 127.0.0.2 open no connection and are answered, whether
    they name a stranger or copy the pair's own D dict with only the host changed (an
    engine id is no proof of where a peer is); the pair's own D is read as before."""
    pair = engine_pair(prefill={"enable_prefix_caching": False})  # P's reads stay visible
    for which in ("p", "d"):
        assert "Peer allowlist: KV is read only from 127.0.0.1/32" in _log(pair, which)
    rng = random.Random("topology-default")
    prompt = random_prompt(rng, 200)
    _, d1 = pair.turn(prompt, 8)
    assert d1 is not None and d1.ok and d1.params is not None
    prompt2 = [*prompt, *d1.token_ids, *random_prompt(rng, 3)]
    copied = d1.params.for_prefill_hit().with_fields(
        remote_host="127.0.0.2", remote_port=outsider.port
    )
    p0, _ = pair.snap()
    for params in (_foreign_d_params(outsider.port), copied):
        r = pair.p.complete(prompt2, 1, params)
        assert r.ok, (r.status, r.error)  # answered, no 5xx
    assert outsider.accepted == 0
    assert (pair.p.metrics() - p0).value(REFUSED) == 2
    # the pair's own D, at its own address: read, not refused
    p1, _ = pair.snap()
    pr = pair.p.complete(prompt2, 1, d1.params.for_prefill_hit())
    assert pr.ok, (pr.status, pr.error)
    delta = pair.p.metrics() - p1
    assert delta.value(REFUSED) == 0
    assert sources(delta)["external_kv_transfer"] == d1.params.remote_num_tokens, sources(delta)


def test_without_an_allowlist_p_connects_where_params_say(
    engine_pair: Factory, outsider: Listener
) -> None:
    """The negative control (vLLM's behaviour, said once at start): the listener sees P."""
    # the topology's own allowlist off: this pair must be open to show what open does
    pair = engine_pair(kv={"kv_load_failure_policy": "recompute"}, peer_allowlist=False)
    prompt = random_prompt(random.Random("no-allowlist"), 200)
    r = pair.p.complete(prompt, 1, _foreign_d_params(outsider.port))
    assert r.ok, (r.status, r.error)
    assert outsider.accepted >= 1
    assert _log(pair, "p").count("bidir_kv_peer_allowlist is unset") == 1


def test_prefill_node_refuses_remote_prefill_params_with_400(
    engine_pair: Factory, outsider: Listener
) -> None:
    pair = engine_pair()
    params = _foreign_d_params(outsider.port, do_remote_decode=False, do_remote_prefill=True)
    r = fetch(
        pair.p.url + "/v1/completions",
        method="POST",
        timeout=30,
        json={
            "model": "tiny",
            "prompt": random_prompt(random.Random("dp"), 50),
            "max_tokens": 1,
            "kv_transfer_params": params.to_dict(),
        },
    )
    assert r.status == 400 and "do_remote_prefill" in r.text, (r.status, r.text)
    assert outsider.accepted == 0


def test_claim_with_non_integer_block_ids_is_400(engine_pair: Factory) -> None:
    pair = engine_pair()
    for blocks in (["a"], [1.5], [True], [None]):
        r = fetch(
            pair.d.url + "/_emulator/claim",
            method="POST",
            json={"request_id": "x", "blocks": blocks, "reader": "r"},
            timeout=30,
        )
        assert r.status == 400 and "'blocks'" in r.text, (blocks, r.status, r.text)
