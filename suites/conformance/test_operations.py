"""Operational events on a P/D pair (issue 16): memory pressure, bursts, bounded
queues, restarts with the same engine id.

The scenarios run on the backend's *small pair* (``bidir_kv.testing.pairs.small_pair``,
shared with any scenario that fits it), so restarts and full KV caches never reach the
session's main pair: D gets ``SMALL_D_BLOCKS`` KV blocks (``--num-gpu-blocks-override``
on vLLM, ``--kv-capacity-tokens`` on the emulator) and a short retention TTL. Each
scenario first releases what earlier users of the pair left retained on D
(``SharedPair.drain``). Every wait is bounded by the timing's window: a request still
unanswered then is reported as stalled (with D's queue gauges), never waited for.
The emulator runs twice: with its defaults (the safe behaviour) and with the flags that
reproduce vLLM 0.32 (``--peer-cache vllm --retained-blocks pin
--max-waiting-seconds 0``, docs/engine.md "Operations"); the second must show what
real vLLM shows. Findings and evidence: docs/conformance.md "Operational scenarios".

D's memory is counted in blocks of one KV cache group and the turns are continued
through the engines' prefix caches, so the scenarios are generated for model families
with one group and a prefix cache only (dense, MoE; not the hybrid or MLA families,
bidir_kv.testing.families).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.client import COMPLETIONS_PATH, Completion, TransportError, fetch
from bidir_kv.policy import cache_ttl_below_retention
from bidir_kv.protocol import KVTransferParams
from bidir_kv.testing.backends import PDBackend, PromptFactory
from bidir_kv.testing.faults import confirm_logged
from bidir_kv.testing.pairs import (
    KV_USAGE,
    SMALL_PAIR_TIMING,
    SharedPair,
    Timing,
    small_pair,
)
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.testing.poll import wait_for
from bidir_kv.testing.router import start_router_process
from bidir_kv.testing.scenario import complete_watching, evidence, queue_state
from bidir_kv.wire.fence import FAULT_RELEASE_CONFIG_KEY, FENCE_KEY

# D's memory arithmetic assumes one KV cache group and engines with a prefix cache
pytestmark = pytest.mark.requires_model("one_kv_group", "prefix_cache")

# A turn of FILL new tokens and GEN generated keeps 3 of D's 11 usable blocks retained;
# three of them leave 2 free, one short of the next turn's 3.
FILL_TURNS, GEN = 3, 8
VLLM_FLAGS = ("--peer-cache", "vllm", "--retained-blocks", "pin", "--max-waiting-seconds", "0")
TOKEN = 7  # the probe prompt (an ordinary token on both models)


def _fill_tokens(bs: int) -> int:
    return 2 * bs + 100


TIMING = SMALL_PAIR_TIMING

# Scenarios a backend does not certify, with the reason (none at present: our connector
# gives retained blocks back early behind the fence of docs/connector.md §5).
OUT_OF_SCOPE: dict[str, dict[str, str]] = {}


@pytest.fixture(autouse=True)
def _in_scope(request: pytest.FixtureRequest, pd: PDBackend) -> None:
    reason = OUT_OF_SCOPE.get(pd.name, {}).get(request.function.__name__)
    if reason:
        pytest.skip(reason)


@dataclass
class Ops:
    """The module's mode and its backend's small pair for each set of flags (shared
    through the backend's pool: a set starts once per session and backend)."""

    pd: PDBackend
    mode: str
    timing: Timing

    def pair(
        self,
        *emulator_flags: str,
        decode_extra: tuple[tuple[str, Any], ...] = (),
        decode_prefix_caching: bool = True,
    ) -> SharedPair:
        """The pair for a scenario; ``emulator_flags`` only apply in the default mode
        (the vLLM mode's flags are fixed), and never to real vLLM; ``decode_extra``:
        more ``kv_connector_extra_config`` keys for D (our connector's)."""
        flags = VLLM_FLAGS if self.mode == "vllm" else tuple(emulator_flags)
        if self.pd.name != "emulator":
            flags = ()
        return self.pd.pair(
            small_pair(
                self.pd.name,
                decode_kv=decode_extra,
                emulator_args=flags,
                decode_prefix_caching=decode_prefix_caching,
            )
        )


@pytest.fixture(
    scope="module",
    params=["default", pytest.param("vllm", marks=pytest.mark.only_backends("emulator"))],
)
def ops(request: pytest.FixtureRequest, pd: PDBackend) -> Iterator[Ops]:
    """``default``: the backend as it is; ``vllm``: the emulator with the flags that
    reproduce vLLM 0.32 (not generated for other backends: they are what they are)."""
    mode = str(request.param)
    if pd.name not in TIMING:
        pytest.skip("needs a local backend that can start pairs of its own")
    yield Ops(pd, mode, TIMING[pd.name])


# ---- helpers ------------------------------------------------------------------------


def reference(p: EngineClient, prompt: Sequence[int], gen: int) -> list[int]:
    """Greedy output computed on the pair's P from nothing (a fresh ``cache_salt``)."""
    salt = f"ref-{time.time_ns()}"
    return p.complete(prompt, gen, extra={"cache_salt": salt}).raise_for_status().token_ids


@dataclass
class TurnLegs:
    prompt: list[int]
    p: Completion | None  # None: P did not answer in time (``no_answer``)
    d: Completion | None
    d_queue: dict[str, float] = field(default_factory=dict)  # D's gauge peaks meanwhile
    no_answer: TransportError | None = None  # the leg that did not answer in time

    @property
    def answered(self) -> Completion:
        """The response the client got (P's failure, or D's)."""
        got = self.d if self.d is not None else self.p
        assert got is not None, f"no answer: {self.no_answer}"
        return got

    @property
    def sequence(self) -> list[int]:
        assert self.d is not None
        return [*self.prompt, *self.d.token_ids]


def turn(
    pair: SharedPair, prompt: list[int], timeout: float, previous: KVTransferParams | None = None
) -> TurnLegs:
    """P leg then D leg, each bounded by ``timeout`` (``no_answer``: none in time);
    D's queue gauges are sampled while its leg is pending."""
    sent = KVTransferParams.miss() if previous is None else previous.for_prefill_hit()
    try:
        p = pair.prefill.complete(prompt, 1, sent, timeout=timeout)
    except TransportError as exc:
        return TurnLegs(prompt, None, None, no_answer=exc)
    if not p.ok or p.params is None:
        return TurnLegs(prompt, p, None)
    d, peak = complete_watching(pair.decode, prompt, GEN, p.params, timeout)
    if isinstance(d, TransportError):
        return TurnLegs(prompt, p, None, peak, no_answer=d)
    if d.params is not None:
        pair.held.append(d.params)  # released by the pair's next drain
    return TurnLegs(prompt, p, d, peak)


def stalled(what: str, t: TurnLegs, pair: SharedPair, timing: Timing) -> str:
    if t.no_answer is not None:
        return (
            f"{what}: no answer within {timing.window:g} s (D's TTL {timing.ttl:g} s); "
            f"D's queue peaks meanwhile: {t.d_queue}, KV usage then "
            f"{pair.decode.metrics([KV_USAGE]).value(KV_USAGE):.2f}"
        )
    r = t.answered
    return f"{what}: HTTP {r.status} {r.error}"


@contextlib.contextmanager
def filled(pair: SharedPair, prompts: PromptFactory, bs: int, timing: Timing) -> Iterator[None]:
    """FILL_TURNS turns nobody continues, retained by D until its TTL (or released
    when the next scenario starts)."""
    pair.drain(timing.ttl + 30)
    for i in range(FILL_TURNS):
        t = turn(pair, prompts.prompt(_fill_tokens(bs)), timing.window)
        assert t.d is not None and t.d.ok and t.d.params is not None, stalled(
            f"filling turn {i}", t, pair, timing
        )
    yield


# ---- memory pressure ----------------------------------------------------------------


@pytest.mark.timeout(900)
def test_retained_blocks_do_not_starve_new_requests(ops: Ops, prompts: PromptFactory) -> None:
    """D's KV full of retained turns: a new request is served within the window
    (D gives up retained blocks) and its output is correct."""
    pair, bs = ops.pair(), ops.pd.block_size
    with filled(pair, prompts, bs, ops.timing):
        t = turn(pair, prompts.prompt(_fill_tokens(bs)), ops.timing.window)
    assert t.d is not None and t.d.ok, stalled("the request after the fill", t, pair, ops.timing)
    assert t.d.token_ids == reference(pair.prefill, t.prompt, GEN)


@pytest.mark.timeout(900)
def test_queued_request_has_a_bound_and_a_clear_error(ops: Ops, prompts: PromptFactory) -> None:
    """Memory pinned by retained turns (the emulator: ``--retained-blocks pin``): a
    request D cannot admit is answered within the window, served or with an error
    that names why; it never waits unboundedly."""
    bound = str(ops.timing.window / 2)
    pair, bs = (
        ops.pair("--retained-blocks", "pin", "--max-waiting-seconds", bound),
        ops.pd.block_size,
    )
    with filled(pair, prompts, bs, ops.timing):
        t = turn(pair, prompts.prompt(_fill_tokens(bs)), ops.timing.window)
    assert t.no_answer is None, stalled("the queued request", t, pair, ops.timing)
    r = t.answered
    if not r.ok:
        assert r.status in (429, 503), f"a bounded wait ends in 429/503, got {r.status}"
        assert r.error and "wait" in r.error.lower(), f"the error must say why: {r.error}"
    else:
        assert r.token_ids == reference(pair.prefill, t.prompt, GEN)


def _ask(url: str, prompt: list[int], timeout: float) -> tuple[int | None, list[int], str]:
    """One request through the router without a conversation id: (status, token ids,
    why not); status ``None``: no answer at all."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": GEN,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    try:
        reply = fetch(url + COMPLETIONS_PATH, method="POST", json=body, timeout=timeout)
    except TransportError as exc:
        return None, [], f"no answer within {timeout:g} s: {exc}"
    if not reply.ok:
        return reply.status, [], reply.text[:300]
    return reply.status, [int(x) for x in reply.json()["choices"][0]["token_ids"]], ""


@pytest.mark.timeout(900)
def test_burst_without_conversation_ids_is_served(ops: Ops, prompts: PromptFactory) -> None:
    """Through our router, turns without a conversation id (nothing is stored, so no
    one will continue them): three times D's capacity in a row, each answered within
    the window and correct, and D's KV is not left pinned until the TTL."""
    pair, bs, timing = ops.pair(), ops.pd.block_size, ops.timing
    pair.drain(timing.ttl + 30)
    p, d = pair.prefill.node, pair.decode.node
    extra = [
        "--cache-ttl",
        str(cache_ttl_below_retention(timing.ttl, margin=5.0)),
        "--decoder-kv-blocks-ttl",
        str(timing.ttl),
        "--block-size",
        str(bs),
    ]
    if not ops.pd.streams_params:  # may probe the main pair: the small pair is paused then
        extra += ["--decode-stream", "never"]
    pair.use()  # the router's traffic does not go through the pair's clients
    router = start_router_process(
        ops.pd.run_dir,
        [(p.host, p.port)],
        [(d.host, d.port)],
        extra,
        name=f"router-ops-{ops.pd.name}",
        timeout=120,
        ready_path="/health",
    )
    try:
        done = []
        for i in range(3 * FILL_TURNS):
            prompt = prompts.prompt(_fill_tokens(bs))
            status, ids, err = _ask(router.url, prompt, timing.window)
            assert status == 200, (
                f"burst turn {i}: HTTP {status} {err}; D's queue {queue_state(pair.decode)}"
            )
            done.append((prompt, ids))
        wait_for(
            lambda: pair.blocks_in_use() <= 1,
            timing.window,
            "D to free the burst's blocks (before its TTL)",
            interval=0.5,
        )
    finally:
        router.proc.stop()
    wrong = [
        i for i, (prompt, ids) in enumerate(done) if ids != reference(pair.prefill, prompt, GEN)
    ]
    assert not wrong, f"burst turns {wrong} differ from recompute"


# ---- restarts with the same engine id --------------------------------------------------


@pytest.mark.timeout(900)
def test_d_restarted_next_turn_misses_and_reuse_resumes(ops: Ops, prompts: PromptFactory) -> None:
    """D restarts (same engine id and ports): the next turn of a conversation is a
    clean miss with correct output (P's policy ``recompute``), and the turn after
    pulls from the new D again, P not restarted."""
    pair, bs, timing = ops.pair(), ops.pd.block_size, ops.timing
    pair.drain(timing.ttl + 30)
    t0 = turn(pair, prompts.prompt(bs + 100), timing.window)
    assert t0.d is not None and t0.d.ok and t0.d.params is not None, stalled(
        "turn 1", t0, pair, timing
    )
    # turn 2 makes P read from D, so P knows D (handshake) before D restarts
    t1 = turn(pair, [*t0.sequence, *prompts.tokens(bs)], timing.window, t0.d.params)
    assert t1.d is not None and t1.d.ok and t1.d.params is not None, stalled(
        "turn 2", t1, pair, timing
    )
    pair.restart("decode")
    t2 = turn(pair, [*t1.sequence, *prompts.tokens(bs)], timing.window, t1.d.params)
    assert t2.d is not None and t2.d.ok and t2.d.params is not None, stalled(
        "the turn after D's restart", t2, pair, timing
    )
    assert t2.d.token_ids == reference(pair.prefill, t2.prompt, GEN)
    before = pair.prefill.metrics()
    t3 = turn(pair, [*t2.sequence, *prompts.tokens(50)], timing.window, t2.d.params)
    ev = evidence(pair.prefill.metrics() - before)
    assert t3.d is not None and t3.d.ok, stalled("the second turn after", t3, pair, timing)
    assert ev.pulled, f"P did not pull from the restarted D: {ev}"
    assert t3.d.token_ids == reference(pair.prefill, t3.prompt, GEN)


@pytest.mark.timeout(900)
def test_p_restarted_new_and_existing_conversations_served(
    ops: Ops, prompts: PromptFactory
) -> None:
    """P restarts (same engine id and ports, new process and NIXL agent): new
    conversations and the next turn of an existing one are served correctly, and D
    pulls from the new P again, D not restarted. One failed read per peer is
    allowed (a 0.32 dict cannot say P restarted; policy ``recompute`` makes it a miss)."""
    pair, bs, timing = ops.pair(), ops.pd.block_size, ops.timing
    pair.drain(timing.ttl + 30)
    t1 = turn(pair, prompts.prompt(bs + 100), timing.window)
    assert t1.d is not None and t1.d.ok and t1.d.params is not None, stalled(
        "turn 1", t1, pair, timing
    )
    pair.restart("prefill")
    for i in range(2):
        before = pair.decode.metrics()
        fresh = turn(pair, prompts.prompt(bs + 100), timing.window)
        ev = evidence(pair.decode.metrics() - before)
        assert fresh.d is not None and fresh.d.ok, stalled(
            f"new conversation {i} after P's restart", fresh, pair, timing
        )
        assert fresh.d.token_ids == reference(pair.prefill, fresh.prompt, GEN)
        assert i == 0 or ev.pulled, f"D did not pull the new conversation from the new P: {ev}"
    before = pair.decode.metrics()
    t2 = turn(pair, [*t1.sequence, *prompts.tokens(50)], timing.window, t1.d.params)
    ev = evidence(pair.decode.metrics() - before)
    assert t2.d is not None and t2.d.ok, stalled(
        "the existing conversation after P's restart", t2, pair, timing
    )
    assert t2.d.token_ids == reference(pair.prefill, t2.prompt, GEN)
    assert ev.pulled, f"D did not pull from the restarted P: {ev}"


# ---- the fence: a turn released while P reads it ------------------------------------
# (last: its pair is D with the fault and without a prefix cache, started once the
# scenarios of the default pair are done)


@pytest.mark.timeout(900)
def test_release_during_read_is_recomputed(ops: Ops, prompts: PromptFactory) -> None:
    """D releases a turn and rewrites its blocks around P's READ of it (fault injection:
    the emulator's ``release_on_claim``, our connector's
    ``bidir_kv_fault_release_exported``). P sees the fence word change, discards what it
    read and recomputes: the answer equals the oracle's and P says so in its log."""
    if ops.mode == "vllm":
        pytest.skip("the emulator's vLLM mode has no fence (nothing is released early)")
    if ops.pd.name == "vllm-cpu":
        pytest.skip("the fault is our connector's: stock vLLM never releases a turn early")
    # D without a prefix cache: the fault rewrites released blocks without evicting
    # them from D's cache (a real reuse would), so D must not hit them itself
    pair, bs = (
        ops.pair(
            "--fault-release-on-claim",
            decode_extra=((FAULT_RELEASE_CONFIG_KEY, True),),
            decode_prefix_caching=False,
        ),
        ops.pd.block_size,
    )
    pair.drain(ops.timing.ttl + 30)
    d_log = pair.decode.node.log_path
    assert d_log is not None
    mark = Path(d_log).stat().st_size
    first = turn(pair, prompts.prompt(_fill_tokens(bs)), ops.timing.window)
    assert first.d is not None and first.d.ok and first.d.params is not None, stalled(
        "the first turn", first, pair, ops.timing
    )
    assert FENCE_KEY in first.d.params.extra, "D exported no fence word"
    prompt = [*first.sequence, *prompts.tokens(40)]
    t = turn(pair, prompt, ops.timing.window, first.d.params)
    # the fault took effect: D released the turn (the emulator when P claims the read,
    # our connector right after exporting it), as D's log says
    confirm_logged(
        "D's release of the fenced turn",
        d_log,
        "fault release_on_claim: releasing" if ops.pd.name == "emulator" else "(fault injection;",
        since=mark,
    )
    assert t.d is not None and t.d.ok, stalled("the turn after the release", t, pair, ops.timing)
    assert t.d.token_ids == reference(pair.prefill, t.prompt, GEN)
    assert pair.prefill.node.log_path is not None
    log = Path(pair.prefill.node.log_path).read_text(errors="replace").lower()
    assert "fence:" in log and "discarding the read" in log, "P did not discard the read"
