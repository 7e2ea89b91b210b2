"""Fixtures of the hardware tier: the P/D deployment under test and the measured rounds.

Three ways to get a deployment (docs/hardware.md §3), same tests on each:

* by URL: ``--prefill-url`` / ``--decode-url`` of running servers (a release runner);
* ``--hw-launch``: P and D started here with ``bidir-kv serve`` on two GPU/core sets and
  stopped after the tier;
* otherwise the dry run: the vllm-cpu pair (real vLLM on CPU, P's prefix cache off as in
  the recipe), through the topology abstraction. CI runs this.

Without any of them the tier skips, or fails under ``--require-tier hardware``.

Every test reads its measurements through the session fixture ``hw_measurements``: a
length is measured the first time a test of this process asks for it, so each test runs
alone (by node id), in any order and under xdist (each worker measures for itself).
"""

from __future__ import annotations

import contextlib
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.client import Completion, run_pd_turn
from bidir_kv.fabric.counters import deltas
from bidir_kv.fabric.probe import ONE_HOST, FabricProbe
from bidir_kv.launch.process import ProcessFailed
from bidir_kv.protocol import KVTransferParams
from bidir_kv.scrape import (
    NIXL_BYTES,
    NIXL_EXPIRED,
    NIXL_FAILED,
    NIXL_XFERS,
    WATCHED,
    MetricsSnapshot,
)
from bidir_kv.testing.gating import required_tiers, skip_or_fail
from bidir_kv.testing.hw_gates import LengthResult
from bidir_kv.testing.hw_options import HwOptions, hw_options
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.testing.poll import settled
from bidir_kv.topology.base import BackendUnavailable, Node
from bidir_kv.topology.vllm_cpu import VLLM_CPU_VERSION

__all__ = [
    "TWO_HOSTS_PROVISION",
    "HwDeployment",
    "HwMeasurements",
    "HwShape",
    "dry_run_launcher",
    "hw_deployment",
    "hw_measurements",
    "hw_results",
    "is_remote",
    "measure_conversations",
    "measure_length",
    "measure_turn",
    "run_round",
]

NIXL_XFER_TIME = "vllm:nixl_xfer_time_seconds_sum"
_NAMES = (*WATCHED, NIXL_XFER_TIME)
NEW_TOKENS = 150  # the blog's per-turn user input
OUTPUT_TOKENS = 32
# D's answer to a measured dry-run round (turn 2 alone): enough tokens for a TPOT
DRY_RUN_ANSWER_TOKENS = 8
_MEASUREMENTS: pytest.StashKey[HwMeasurements] = pytest.StashKey()
_DEPLOYMENT: pytest.StashKey[dict[str, Any]] = pytest.StashKey()


@dataclass
class HwDeployment:
    """A P/D pair as the tier sees it."""

    kind: str  # "url", "launch" or "vllm-cpu"
    prefill: EngineClient
    decode: EngineClient
    block_size: int
    threshold: int
    token_range: tuple[int, int]  # ordinary token ids of the model
    kv_bytes_per_token: float | None = None  # None: unknown shape (rounds must agree)
    decoder_ttl: float | None = None  # D's decoder_kv_blocks_ttl when known
    description: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None
    launcher: str = "local"  # how P and D were placed (docs/hardware.md §3)
    fabric: FabricProbe | None = None  # P's NIC counters; None: one host, no fabric

    def prompt(self, rng: random.Random, n: int) -> list[int]:
        lo, hi = self.token_range
        return [rng.randrange(lo, hi) for _ in range(n)]


# (conversations, turns, clients) on GPU: the publication's 10 x 10 turns by 2 clients;
# --hw-quick's smoke run; the vllm-cpu dry run's turn 2 alone (--hw-rounds rounds)
GPU_SHAPE, QUICK_SHAPE, CPU_SHAPE = (10, 10, 2), (1, 3, 1), (1, 2, 1)


def is_remote(config: pytest.Config) -> bool:
    """A deployment by URL or launched for a release (GPU/Trn), not the vllm-cpu dry run."""
    return hw_options(config).remote


@dataclass(frozen=True)
class HwShape:
    """What one length's measurement is: ``rounds`` of turn 2 alone (``turns`` 2), or
    ``conversations`` of ``turns`` turns by ``clients`` concurrent clients."""

    conversations: int
    turns: int
    clients: int
    rounds: int
    answer_tokens: int

    @property
    def measured_turns(self) -> int:
        return self.rounds if self.turns == 2 else self.conversations * (self.turns - 1)

    @classmethod
    def from_options(cls, opts: HwOptions) -> HwShape:
        base = (QUICK_SHAPE if opts.quick else GPU_SHAPE) if opts.remote else CPU_SHAPE
        given = (opts.conversations, opts.turns, opts.clients)
        conv, turns, clients = (g if g is not None else b for g, b in zip(given, base, strict=True))
        return cls(conv, turns, clients, rounds=opts.rounds, answer_tokens=opts.answer_tokens)


class HwMeasurements:
    """OFF/ON turns per history length on the tier's deployment, each length measured
    once per session (per xdist worker) when a test first asks for it."""

    def __init__(self, shape: HwShape) -> None:
        self.shape = shape
        self.results: dict[int, LengthResult] = {}
        self.round_s: dict[int, list[float]] = {}  # wall time of each round (or the sweep)
        self.failures: dict[int, str] = {}  # lengths whose measurement failed, and why
        self._deployment: HwDeployment | None = None

    def length(self, dep: HwDeployment, history: int) -> LengthResult:
        """The shape's OFF/ON turns at ``history`` tokens on ``dep`` (measured on first
        use; a new deployment starts over). A measurement that failed is not repeated:
        later tests asking for that length fail at once with the first error."""
        if dep is not self._deployment:
            self._deployment = dep
            self.results.clear()
            self.round_s.clear()
            self.failures.clear()
        if history in self.failures:
            pytest.fail(
                f"length {history} could not be measured: {self.failures[history]}", pytrace=False
            )
        if history not in self.results:
            times: list[float] = []
            try:
                self.results[history] = self._measure(dep, history, times)
            except Exception as exc:
                self.failures[history] = f"{type(exc).__name__}: {exc}"[:2000]
                raise
            self.round_s[history] = times
        return self.results[history]

    def _measure(self, dep: HwDeployment, history: int, times: list[float]) -> LengthResult:
        sh = self.shape
        if sh.turns == 2:
            return measure_length(dep, history, sh.rounds, round_s=times)
        res = LengthResult(history_tokens=history, prompt_tokens=0)
        t0 = time.perf_counter()
        measure_conversations(
            dep,
            history,
            res,
            conversations=sh.conversations,
            turns=sh.turns,
            clients=sh.clients,
            answer_tokens=sh.answer_tokens,
        )
        times.append(time.perf_counter() - t0)
        return res

    def lengths(self, dep: HwDeployment, histories: list[int]) -> list[LengthResult]:
        """Every length of the run, in order (calibration fits over all of them)."""
        return [self.length(dep, n) for n in sorted(histories)]


def hw_results(config: pytest.Config) -> dict[int, LengthResult]:
    """What this session measured so far, per history length (for the report)."""
    measured = config.stash.get(_MEASUREMENTS, None)
    return dict(measured.results) if measured is not None else {}


@pytest.fixture(scope="session")
def hw_measurements(pytestconfig: pytest.Config) -> HwMeasurements:
    """The session's measurements; tests ask it for a length instead of reading another
    test's results."""
    measured = HwMeasurements(HwShape.from_options(hw_options(pytestconfig)))
    pytestconfig.stash[_MEASUREMENTS] = measured
    return measured


def deployment_info(config: pytest.Config) -> dict[str, Any]:
    return config.stash.setdefault(_DEPLOYMENT, {})


def _metrics(client: EngineClient, timeout: float = 5.0) -> MetricsSnapshot:
    """P's counters once two scrapes agree (transfer stats land a step after the answer)."""
    return settled(
        lambda: client.metrics(_NAMES), timeout, same=lambda a, b: a.samples == b.samples
    )


def _finish_on_d(
    dep: HwDeployment,
    prompt: list[int],
    p_params: KVTransferParams | None,
    tokens: int = 1,
    tpot: list[float] | None = None,
) -> Completion | None:
    """D's leg of the turn: D reads what P holds for it, so no P lease is left to lapse
    and count as an expired transfer in a later round; ``tokens`` is the answer's length
    (1 when the conversation ends here). With ``tpot``, an answer of more than one token
    is streamed and its TPOT appended (the decode gate, :func:`gate_tpot`)."""
    if p_params is None:
        return None
    stream = tpot is not None and tokens > 1
    out = dep.decode.complete(prompt, tokens, p_params, stream=stream)
    if stream and out.ok and out.tpot is not None:
        assert tpot is not None
        tpot.append(out.tpot)
    return out


def measure_turn(
    dep: HwDeployment,
    prompt: list[int],
    d_params: KVTransferParams,
    res: LengthResult,
    off_first: bool,
    answer_tokens: int = 1,
    lock: threading.Lock | None = None,
) -> Completion | None:
    """A measured turn >= 2: P's prefill of ``prompt`` twice, OFF (miss dict, fresh
    cache_salt so nothing local is reused) and ON (D's dict), in the order given; both
    are finished on D with ``answer_tokens`` tokens, streamed, so D decodes the same in
    both and each answer's TPOT is recorded (the ON answer carries the conversation on
    and is returned). ``lock`` serializes the prefills of concurrent clients, so P's
    counter deltas belong to one request."""
    p = dep.prefill
    res.prompt_tokens = max(res.prompt_tokens, len(prompt))
    guard = lock or contextlib.nullcontext()
    answer: list[Completion | None] = [None]

    def off() -> None:
        salt = {"cache_salt": f"hw-off-{secrets.token_hex(8)}"}
        with guard:
            out = p.complete(prompt, 1, KVTransferParams.miss(), extra=salt)
        assert out.ok, f"OFF prefill failed: {out.error}"
        res.off_s.append(out.elapsed)
        _finish_on_d(dep, prompt, out.params, answer_tokens, res.off_tpot_s)

    def on() -> None:
        with guard:
            before = _metrics(p)
            counted = dep.fabric.read() if dep.fabric else {}
            out = p.complete(prompt, 1, d_params.for_prefill_hit())
            assert out.ok, f"ON prefill failed: {out.error}"
            delta = _metrics(p) - before  # settled: the read's transfer stats have landed
            if dep.fabric:
                res.fabric.append(deltas(counted, dep.fabric.read()))
        res.on_s.append(out.elapsed)
        res.pulled_tokens.append(
            int(delta.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer"))
        )
        res.bytes_moved.append(delta.value(NIXL_BYTES))
        res.xfer_s.append(delta.value(NIXL_XFER_TIME))
        res.xfers.append(int(delta.value(NIXL_XFERS)))
        res.failed += int(delta.value(NIXL_FAILED))
        res.expired += int(delta.value(NIXL_EXPIRED))
        answer[0] = _finish_on_d(dep, prompt, out.params, answer_tokens, res.on_tpot_s)

    for step in (off, on) if off_first else (on, off):
        step()
    return answer[0]


def run_round(
    dep: HwDeployment, rng: random.Random, history: int, res: LengthResult, off_first: bool
) -> None:
    """One turn 1, then turn 2 measured (:func:`measure_turn`)."""
    turn1 = run_pd_turn(dep.prefill, dep.decode, dep.prompt(rng, history), OUTPUT_TOKENS)
    assert turn1.d is not None and turn1.d.ok, f"turn 1 failed: {turn1.d or turn1.p}"
    assert turn1.d.params is not None, "D returned no kv_transfer_params: bidirectional off?"
    prompt2 = [*turn1.sequence, *dep.prompt(rng, NEW_TOKENS)]
    measure_turn(dep, prompt2, turn1.d.params, res, off_first, DRY_RUN_ANSWER_TOKENS)


def measure_conversations(
    dep: HwDeployment,
    history: int,
    res: LengthResult,
    *,
    conversations: int,
    turns: int,
    clients: int,
    answer_tokens: int,
    seed: int = 0,
) -> None:
    """The publication's shape: ``conversations`` of ``turns`` turns on a ``history``-token
    prefix, ``NEW_TOKENS`` user tokens and ``answer_tokens`` answer tokens per turn, by
    ``clients`` concurrent clients; every turn >= 2 measured OFF and ON
    (:func:`measure_turn`, alternating the order), its ON answer carrying the
    conversation on."""
    lock = threading.Lock()
    errors: list[BaseException] = []

    def conversation(i: int) -> None:
        rng = random.Random(f"hw-{seed}-{history}-{i}")
        turn1 = run_pd_turn(dep.prefill, dep.decode, dep.prompt(rng, history), answer_tokens)
        assert turn1.d is not None and turn1.d.ok and turn1.d.params is not None, (
            f"conversation {i}: turn 1 failed: {turn1.d or turn1.p}"
        )
        seq, params = turn1.sequence, turn1.d.params
        for turn in range(2, turns + 1):
            prompt = [*seq, *dep.prompt(rng, NEW_TOKENS)]
            out = measure_turn(
                dep,
                prompt,
                params,
                res,
                off_first=(i + turn) % 2 == 0,
                answer_tokens=answer_tokens,
                lock=lock,
            )
            assert out is not None and out.ok, (
                f"conversation {i} turn {turn}: D's answer failed: {out}"
            )
            assert out.params is not None, (
                f"conversation {i} turn {turn}: D's streamed answer carried no "
                "kv_transfer_params (vLLM before PR #40186 puts none on streams); the tier "
                "streams D's answers to measure TPOT: use a vLLM with the PR, or measure "
                "turn 2 alone (--hw-turns 2)"
            )
            seq, params = [*prompt, *out.token_ids], out.params

    def client(first: int) -> None:
        try:
            for i in range(first, conversations, clients):
                conversation(i)
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def measure_length(
    dep: HwDeployment, history: int, rounds: int, seed: int = 0, round_s: list[float] | None = None
) -> LengthResult:
    """``rounds`` OFF/ON pairs at ``history`` tokens, alternating which goes first; each
    whole round's wall time is appended to ``round_s`` when given."""
    rng = random.Random(f"hw-{seed}-{history}")
    res = LengthResult(history_tokens=history, prompt_tokens=0)
    for i in range(rounds):
        t0 = time.perf_counter()
        run_round(dep, rng, history, res, off_first=i % 2 == 0)
        if round_s is not None:
            round_s.append(time.perf_counter() - t0)
    return res


def warm_up(dep: HwDeployment) -> None:
    """One discarded round: the first D->P read pays the NIXL handshake."""
    run_round(
        dep,
        random.Random("hw-warm-up"),
        2 * dep.block_size,
        LengthResult(history_tokens=0, prompt_tokens=0),
        off_first=True,
    )


# ---- deployments ------------------------------------------------------------------


def _placement(config: pytest.Config, dep: HwDeployment) -> dict[str, Any]:
    """What the report and the stored run say about the deployment (the baseline's
    machine info): model, versions, backend, launcher, hosts, fabric."""
    import importlib.metadata

    try:
        nixl = importlib.metadata.version("nixl")
    except importlib.metadata.PackageNotFoundError:
        nixl = None
    return {
        "kind": dep.kind,
        "block_size": dep.block_size,
        "kv_bytes_per_token": dep.kv_bytes_per_token,
        "model": dep.description.get("model") or dep.prefill.model,
        "vllm": dep.description.get("version"),
        "nixl": nixl,
        "backend": "UCX" if dep.kind == "vllm-cpu" else hw_options(config).nixl_backend,
        "launcher": dep.launcher,
        "hosts": dep.description.get("hosts") or [dep.prefill.node.host, dep.decode.node.host],
        "fabric": dep.fabric.what if dep.fabric else ONE_HOST,
    }


def _node(role: str, url: str) -> Node:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        raise pytest.UsageError(f"--{role}-url must look like http://host:port, got {url!r}")
    return Node(
        role="prefill" if role == "prefill" else "decode",
        name=role,
        host=parts.hostname,
        port=parts.port,
    )


def _served_model(url: str) -> str:
    """The first model id ``/v1/models`` lists (what requests must name)."""
    from bidir_kv.client import get_json

    models = get_json(url.rstrip("/") + "/v1/models", timeout=30).get("data") or []
    if not models:
        raise pytest.UsageError(f"{url}/v1/models lists no model; pass --hw-model")
    return str(models[0]["id"])


def _by_url(opts: HwOptions, p_url: str, d_url: str) -> HwDeployment:
    model = opts.model or _served_model(p_url)
    return HwDeployment(
        kind="url",
        prefill=EngineClient(_node("prefill", p_url), model=model, timeout=600),
        decode=EngineClient(_node("decode", d_url), model=model, timeout=600),
        block_size=opts.block_size or 16,
        threshold=opts.threshold,
        token_range=(1000, 20000),
        kv_bytes_per_token=opts.kv_bytes_per_token,
        description={"prefill": p_url, "decode": d_url, "model": model},
    )


TWO_HOSTS_PROVISION = "ci/provision.d/two-hosts.sh"


def dry_run_launcher(option: str | None, two_hosts_missing: str | None, required: bool) -> str:
    """Where the dry run places P and D: ``--hw-launcher`` when given; else (``auto``) on
    two hosts of this machine (``ssh``), or on one (``local``: no fabric, the fabric gate
    skips) when they cannot be made. Where the tier is required (CI), one host is a
    missing piece of infrastructure, not a fallback: it fails naming the provisioning
    step."""
    launcher = option or "auto"
    if launcher != "auto":
        return launcher
    if two_hosts_missing is None:
        return "ssh"
    if required:
        pytest.fail(
            "hardware tier is required here but its dry run cannot have two hosts: "
            f"{two_hosts_missing}. Provision them with `bash {TWO_HOSTS_PROVISION}` (run by "
            "`make provision`), or run on one host, without the fabric gate, with "
            "--hw-launcher local",
            pytrace=False,
        )
    return "local"


def _vllm_cpu(
    opts: HwOptions, run_dir: Path, two_hosts: Callable[[], Any], *, required: bool
) -> HwDeployment:
    """The dry run: on two hosts of this machine through the ssh launcher (``auto`` and
    ``ssh``; ``auto`` falls back to one host where they cannot be made), or one host."""
    from bidir_kv.testing.backend_start import pd_spec
    from bidir_kv.testing.backends import BACKEND_CONFIG, TOKEN_HI, TOKEN_LO
    from bidir_kv.testing.netns import unavailable_reason as two_hosts_missing
    from bidir_kv.topology.vllm_cpu import VllmCpuOptions, VllmCpuTopology, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise BackendUnavailable(reason)
    spec = pd_spec(BACKEND_CONFIG)
    spec = replace(spec, prefill=replace(spec.prefill, enable_prefix_caching=False))  # cold P
    cpu = VllmCpuOptions(log_dir=run_dir / "vllm-cpu", dtype="float32")
    from bidir_kv.plan.modelcfg import load_model_config, model_shape

    shape = model_shape(load_model_config(cpu.model / "config.json"), kv_dtype="float32")
    common: dict[str, Any] = dict(
        kind="vllm-cpu",
        block_size=VllmCpuTopology(spec, cpu).block_size,
        threshold=BACKEND_CONFIG.threshold,
        token_range=(TOKEN_LO, TOKEN_HI),
        kv_bytes_per_token=shape.kv_bytes_per_token(),
        decoder_ttl=BACKEND_CONFIG.decoder_ttl,
    )
    launcher = dry_run_launcher(opts.launcher, two_hosts_missing(), required)
    if launcher == "ssh":
        from bidir_kv.fabric.probe import local_probe
        from bidir_kv.testing.hw_two_hosts import start_pair

        hosts = two_hosts()
        pair = start_pair(spec, cpu, hosts, run_dir / "vllm-cpu", cpu.startup_timeout)
        fabric = opts.fabric
        probe = (
            None
            if fabric == "off"
            else local_probe(
                f"if:{hosts.p_if}" if fabric == "auto" else fabric, opts.fabric_overhead
            )
        )
        return HwDeployment(
            prefill=EngineClient(pair.prefill),
            decode=EngineClient(pair.decode),
            description={
                "backend": "vllm-cpu",
                "version": VLLM_CPU_VERSION,
                "nodes": [pair.prefill.url, pair.decode.url],
                "hosts": [hosts.p_addr, hosts.d_addr],
            },
            close=pair.close,
            launcher="ssh",
            fabric=probe,
            **common,
        )
    topo = VllmCpuTopology(spec, cpu).start()
    return HwDeployment(
        prefill=EngineClient(topo.prefill[0]),
        decode=EngineClient(topo.decode[0]),
        description=topo.describe(),
        close=topo.close,
        **common,
    )


def _deployment(
    opts: HwOptions, run_dir: Path, two_hosts: Callable[[], Any], *, required: bool
) -> HwDeployment:
    if opts.prefill_url and opts.decode_url:  # both or neither (HwOptions.check)
        return _by_url(opts, opts.prefill_url, opts.decode_url)
    if opts.launch:
        from bidir_kv.testing.hw_launch import launch_pair

        p, d, desc, close, probe = launch_pair(opts, run_dir)
        return HwDeployment(
            kind="launch",
            prefill=p,
            decode=d,
            launcher=desc["launcher"],
            fabric=probe,
            block_size=opts.block_size or 16,
            threshold=opts.threshold,
            token_range=(1000, 20000),
            kv_bytes_per_token=opts.kv_bytes_per_token,
            description=desc,
            close=close,
        )
    return _vllm_cpu(opts, run_dir, two_hosts, required=required)


@pytest.fixture(scope="module")
def hw_deployment(
    pytestconfig: pytest.Config, request: pytest.FixtureRequest
) -> Iterator[HwDeployment]:
    """The deployment under test; one per tier module, stopped after it (a real pair keeps
    both cores busy and must be gone before the other tiers run)."""
    opts = hw_options(pytestconfig)
    try:
        dep = _deployment(
            opts,
            opts.report,
            lambda: request.getfixturevalue("two_hosts"),
            required="hardware" in required_tiers(pytestconfig),
        )
    except BackendUnavailable as exc:
        skip_or_fail(pytestconfig, "hardware", f"no deployment for the hardware tier: {exc}")
    except ProcessFailed as exc:
        pytest.fail(f"the hardware tier's deployment failed to start: {exc}", pytrace=False)
    deployment_info(pytestconfig).update({**dep.description, **_placement(pytestconfig, dep)})
    try:
        warm_up(dep)
        yield dep
    finally:
        dep.close()
