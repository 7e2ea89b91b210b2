"""The router's POST /drop_peer (router/peers.py) against stub engines, which have no such
endpoint: the 404 is remembered per node and never retried; engine ids come from params."""

from __future__ import annotations

import pytest

from bidir_kv.testing.router import StubStack, counter

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"


async def test_engine_ids_are_learnt_from_params_and_a_404_is_never_retried() -> None:
    async with StubStack() as s:
        status, _, _ = await s.post(
            CHAT,
            {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]},
        )
        assert status == 200
        p_node, d_node = s.flow.prefill.nodes[0], s.flow.decode.nodes[0]
        assert (p_node.engine_id, d_node.engine_id) == ("p0-engine", "d0-engine")
        peers = s.flow.peers
        peers.down(p_node)  # the probe saw P die: D is asked to drop it
        await peers.settle()
        assert counter(s.flow, "drop_peer", outcome="unsupported") == 1
        assert d_node.drop_peer is False
        # P restarts twice under new engine ids, then dies: each old id is announced
        # to D's role, but D answered 404 once and is never asked again
        peers.seen(p_node, "p0-b")
        peers.seen(p_node, "p0-c")
        peers.down(p_node)
        assert p_node.engine_id == "p0-c"
        await peers.settle()
        assert counter(s.flow, "drop_peer", outcome="unsupported") == 1
        # D dies: P (never asked yet) is asked once, and only once per engine id
        peers.down(d_node)
        peers.down(d_node)
        await peers.settle()
        assert counter(s.flow, "drop_peer", outcome="unsupported") == 2
        assert p_node.drop_peer is False
        assert counter(s.flow, "drop_peer", outcome="sent") == 0
        assert counter(s.flow, "drop_peer", outcome="failed") == 0
