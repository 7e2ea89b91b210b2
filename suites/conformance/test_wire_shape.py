"""Wire shape of the P-node and D-node ``kv_transfer_params`` (docs/protocol.md §3.4-§3.6).

``remote_registration_generation`` is in the key set where the backend's connector has
it (connector version 15, vLLM 0.33; detected, bidir_kv.testing.features). D's params
must ride on the terminal chunk of a stream (vLLM PR #40186, 0.33.0): the releases
without it (0.21.0-0.32.0) are pinned as that defect (bidir_kv.testing.exemptions).
"""

from __future__ import annotations

import time

import pytest

from bidir_kv.policy import cdiv
from bidir_kv.protocol import KVTransferParams, ParamsKind
from bidir_kv.testing.backends import PDBackend, PromptFactory, first_params
from bidir_kv.topology.vllm_source import OPTIONAL_PARAM_FIELDS
from bidir_kv.wire.params import CHAIN_KEY, HeldTokens

# every release since the feature (vLLM 0.21.0) emits these; the others come and go by
# release (OPTIONAL_PARAM_FIELDS), and are expected where the connector has them
COMMON = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "remote_num_tokens",
}


def check_keys(pd: PDBackend, params: KVTransferParams, node: str) -> set[str]:
    """Assert the params' key set; returns the optional fields they carry. A declared
    shape (emulator, external) is checked exactly; a vLLM release's must hold COMMON
    and nothing beyond the fields some release emits and our extensions."""
    got = wire_keys(params)
    own = pd.p_params_extension if node == "prefill" else pd.d_params_extension
    if pd.param_fields is None:
        assert got >= COMMON, f"missing {sorted(COMMON - got)}"
        unknown = got - COMMON - set(OPTIONAL_PARAM_FIELDS) - own
        assert not unknown, f"fields no release emits: {sorted(unknown)}"
        assert pd.has_registration_generation == ("remote_registration_generation" in got)
        return got & set(OPTIONAL_PARAM_FIELDS)
    assert got == expected_keys(pd, node)
    return set(pd.param_fields) & got


def check_groups(pd: PDBackend, params: KVTransferParams, tokens: int) -> None:
    """One list of block ids per KV cache group of the model: a full-attention group
    holds every block of ``tokens``; a sliding-window group no more (vLLM sends only the
    blocks still in the window, ``get_sw_clipped_blocks``)."""
    groups = params.remote_block_ids
    assert groups is not None and len(groups) == pd.kv_groups, (
        f"{pd.family} model: expected {pd.kv_groups} KV cache group(s), got {groups}"
    )
    full = cdiv(tokens, pd.block_size)
    assert max(len(g) for g in groups) == full, groups
    assert all(0 < len(g) <= full for g in groups), groups


def expected_keys(pd: PDBackend, node: str) -> set[str]:
    assert pd.param_fields is not None
    keys = COMMON | (pd.param_fields - {"remote_prefill_cached_tokens"})
    if node == "prefill":
        keys |= pd.param_fields & {"remote_prefill_cached_tokens"}
        keys |= pd.p_params_extension  # e.g. our reader's fence advert (docs/connector.md)
    else:
        keys |= pd.d_params_extension  # e.g. our connector's token chain (docs/connector.md)
    return keys


def wire_keys(params: KVTransferParams) -> set[str]:
    return set(params.to_dict())


@pytest.mark.kv_groups
@pytest.mark.parametrize("length", [200, 1000])
def test_p_node_params(pd: PDBackend, prompts: PromptFactory, length: int) -> None:
    prompt = prompts.prompt(length)
    resp = pd.prefill.complete(prompt, 1, KVTransferParams.miss())
    params = first_params(resp)
    assert params.kind is ParamsKind.PREFILL
    fields = check_keys(pd, params, "prefill")
    assert params.do_remote_prefill is True and params.do_remote_decode is False
    assert params.remote_num_tokens == length
    check_groups(pd, params, length)
    assert params.remote_blocks_expiry_time is None
    if "transfer_mode" in fields:
        assert params.transfer_mode == "pull"
    if "remote_prefill_cached_tokens" in fields:
        assert params.remote_prefill_cached_tokens == 0  # fresh prompt, nothing reused
    assert params.tp_size == 1
    if {"dcp_size", "pp_size"} <= fields:
        assert (params.dcp_size, params.pp_size) == (1, 1)
    side = pd.prefill.node.side_channel_port
    if side is not None:
        assert params.remote_port == side
    engine_id = pd.prefill.node.info.get("engine_id")
    if engine_id:
        assert params.remote_engine_id == engine_id
    assert params.is_valid_remote
    # release P's blocks now rather than after the lease: D reads them
    d = pd.decode.complete(prompt, 2, params).raise_for_status()
    assert d.params is not None


@pytest.mark.kv_groups
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_d_node_params(pd: PDBackend, prompts: PromptFactory, stream: bool) -> None:
    length, gen = 300, 16
    prompt = prompts.prompt(length)
    p_params = first_params(pd.prefill.complete(prompt, 1, KVTransferParams.miss()))
    before = time.perf_counter()
    d = pd.decode.complete(prompt, gen, p_params, stream=stream).raise_for_status()
    assert len(d.token_ids) == gen
    params = d.params
    assert params is not None, "D returned no kv_transfer_params" + (
        " on any chunk of the stream (vLLM PR #40186)" if stream else ""
    )
    if stream:
        assert d.params_on_terminal, "params must ride on the chunk with finish_reason"
        assert all(v is None for v in d.nonterminal_params_values)
    assert params.kind is ParamsKind.DECODE
    fields = check_keys(pd, params, "decode")
    assert params.do_remote_decode is True and params.do_remote_prefill is False
    assert params.remote_num_tokens == length + gen - 1
    check_groups(pd, params, length + gen - 1)
    if "transfer_mode" in fields:
        assert params.transfer_mode == "pull"
    if CHAIN_KEY in pd.d_params_extension:
        held = HeldTokens.from_params(params.extra)
        assert held is not None, f"malformed {CHAIN_KEY}: {params.extra.get(CHAIN_KEY)!r}"
        assert held.num_tokens == params.remote_num_tokens
        assert held.block_size == pd.block_size
    if "remote_blocks_expiry_time" in fields:  # exported since vLLM PR #47021
        expiry = params.remote_blocks_expiry_time
        assert expiry is not None
        if pd.same_clock:
            # D's perf_counter clock, the same CLOCK_MONOTONIC as ours on one machine
            ttl = pd.config.decoder_ttl
            assert before < expiry <= time.perf_counter() + ttl + 1.0
    side = pd.decode.node.side_channel_port
    if side is not None:
        assert params.remote_port == side
    engine_id = pd.decode.node.info.get("engine_id")
    if engine_id:
        assert params.remote_engine_id == engine_id
