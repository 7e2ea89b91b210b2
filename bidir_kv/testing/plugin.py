"""The one pytest plugin: options, markers, tier marks, and the fixture modules it loads.

The root ``conftest.py`` loads this module; it registers the fixture and hook modules
listed in :data:`pytest_plugins`, so suites never import fixtures (and never import
each other). Tier gating (``skip_or_fail``) lives in :mod:`bidir_kv.testing.gating`.

Markers (declared here once; ``--strict-markers`` refuses any other; docs/testing.md):

* **scope**, one per test, from the folder it lives in (``suites/<scope>/``):
  :data:`TIERS`. A scope mark that contradicts the folder is a collection error, so
  ``-m`` on scopes alone never needs to import the other folders (they are not collected).
* **cadence**: ``nightly`` marks a test the pull-request CI does not run; every other test
  gets ``pre_merge``. ``make test``/``.ci/run`` select ``pre_merge``; the nightly workflow
  runs both.
* **backend**: what a test runs against (:data:`BACKEND_MARKS`): a conformance scenario
  gets its ``--backend``'s mark from its parametrization; a test that starts or reaches
  real vLLM itself says so with ``vllm_cpu``/``vllm_cpu_bidir_kv``; each of these, and
  the hardware tier, also gets ``vllm``.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.launch import ledger
from bidir_kv.paths import REPO_ROOT
from bidir_kv.testing import hw_options
from bidir_kv.testing.families import split_backend_id
from bidir_kv.testing.faults import FaultNotApplied
from bidir_kv.testing.gating import REQUIRE_ENV
from bidir_kv.topology.vllm_cpu import EXECUTOR_ENV, PTHR_DELAY_ENV

TIERS = {
    "unit": "pure, in-process tests; laptops, seconds",
    "integration": "emulated P/D topologies as processes or containers",
    "conformance": "backend-agnostic scenarios (emulator, real vLLM on CPU, external)",
    "hardware": "real NIXL on GPU/EFA; OFF/ON TTFT rounds and the release gates",
}
CADENCES = {
    "pre_merge": "run on every pull request and by make test (every test not marked nightly)",
    "nightly": "run by the nightly workflow only (long or wide runs)",
}
BACKENDS = ("emulator", "vllm-cpu", "vllm-cpu+bidir-kv", "external")
# the marker of each --backend, and the one every real-vLLM test carries besides
BACKEND_MARKS = {
    "emulator": "runs against the emulator (bidir-kv engine processes)",
    "vllm_cpu": "runs against stock vLLM on CPU (--backend vllm-cpu)",
    "vllm_cpu_bidir_kv": "runs against vLLM on CPU with our connector (vllm-cpu+bidir-kv)",
    "external": "runs against a running deployment (--prefill-url/--decode-url)",
    "vllm": "starts or reaches real vLLM servers (any vLLM backend, the hardware tier)",
}
VLLM_MARKS = ("vllm_cpu", "vllm_cpu_bidir_kv")
HYPOTHESIS_PROFILES = {"unit": 100, "nightly": 1000}  # max_examples of each profile
# How the tiers run the vllm-cpu servers they start (bidir_kv/topology/vllm_cpu.py reads
# the variables; so do the bench runs a test starts): the model in the EngineCore and
# NIXL's progress thread pausing between polls (docs/testing.md §3, measured there)
# (vLLM's own layout until a whole-suite run validates "uni" and a delay of 100 us, which
# start a pair in 21 s instead of 54 s: docs/conformance.md, "Pairs and what they cost")
TEST_EXECUTOR: str = "mp"
TEST_NIXL_DELAY_US: int | None = None

# Fixture and hook modules, registered by pytest when it loads this plugin.
pytest_plugins = [
    "pytester",  # pytest's own fixture for running a pytest session inside a test
    "bidir_kv.testing.containers",  # docker_client, container_image, container_topology
    "bidir_kv.testing.engines",  # engine_pair, shared_pair
    "bidir_kv.testing.hardware",  # hw_deployment
    "bidir_kv.testing.hw_baseline",  # the deployment in pytest-benchmark's machine info
    "bidir_kv.testing.hw_report",  # the tier's benchmark JSON, JUnit XML and report.md
    "bidir_kv.testing.router",  # redis_server, router_process
    "bidir_kv.testing.router_faults",  # engine_faults
    "bidir_kv.testing.transports",  # kv_backend, nixl_ok
    "bidir_kv.testing.two_hosts",  # two_hosts, ssh_launch
    "bidir_kv.testing.conformance",  # pd, router, prompts; the matrix report
    "bidir_kv.testing.tokenizer",  # tiny_tokenizer_dir
    "bidir_kv.testing.slurm",  # slurm_cluster
]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("bidir-kv")
    group.addoption(
        "--backend",
        action="append",
        choices=BACKENDS,
        default=None,
        help="backend(s) for conformance scenarios (repeatable; default: emulator, "
        "vllm-cpu and vllm-cpu+bidir-kv, plus external when --prefill-url is given)",
    )
    group.addoption("--prefill-url", default=None, help="external backend: prefill node URL")
    group.addoption("--decode-url", default=None, help="external backend: decode node URL")
    group.addoption(
        "--proxy-url",
        default=None,
        help="conformance: also run the through-router scenarios through this running "
        "router (it must front the external backend's P and D)",
    )
    group.addoption(
        "--proxy-cmd",
        default=None,
        help="conformance: also run the through-router scenarios through a router started "
        "by this command, per test; placeholders {python} {port} {prefill_host} "
        "{prefill_port} {decode_host} {decode_port} {block_size} {decoder_ttl} {cache_ttl}",
    )
    hw_options.add_options(parser.getgroup("bidir-kv hardware"))
    group.addoption(
        "--require-tier",
        action="append",
        default=[],
        metavar="TIER",
        help="fail (instead of skip) when TIER's infrastructure is missing; "
        f"also read from {REQUIRE_ENV} (comma-separated)",
    )
    group.addoption(
        "--vllm-executor",
        default=None,
        choices=("mp", "uni"),
        help="the vllm-cpu servers the tiers start: the model in a Worker process (mp, "
        "vLLM's default) or in the EngineCore (uni: one process fewer, faster to start); "
        f"default ${EXECUTOR_ENV} or {TEST_EXECUTOR} (docs/testing.md §3)",
    )
    group.addoption(
        "--nixl-progress-delay-us",
        default=None,
        type=int,
        metavar="US",
        help="the vllm-cpu servers the tiers start: NIXL's progress thread pauses US "
        "microseconds between polls (0: polls without pause, as NIXL's Python API sets "
        f"it); default ${PTHR_DELAY_ENV}, else none (docs/testing.md §3)",
    )


def backend_mark(backend: str) -> str:
    """The marker of a ``--backend`` name (``vllm-cpu+bidir-kv`` -> ``vllm_cpu_bidir_kv``)."""
    return backend.replace("-", "_").replace("+", "_")


def _hypothesis_profiles() -> None:
    """Hypothesis's two profiles, ``unit`` (the default) and ``nightly`` (ten times the
    examples), chosen by ``--hypothesis-profile`` or ``$HYPOTHESIS_PROFILE``. Neither has
    a per-example deadline: the machines are shared and noisy (a real vLLM pair may be
    idling beside the unit tier), and timing is never what a property asserts. A test
    names no ``max_examples`` of its own, so the profile decides how hard each searches.
    Loaded before any test module is imported: a ``settings`` object takes its defaults
    from the profile loaded when it is created."""
    try:
        from hypothesis import settings
    except ImportError:
        return
    for name, examples in HYPOTHESIS_PROFILES.items():
        settings.register_profile(name, max_examples=examples, deadline=None, database=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "unit"))


@pytest.hookimpl(tryfirst=True)  # before hypothesis's own: its --hypothesis-profile wins
def pytest_configure(config: pytest.Config) -> None:
    _hypothesis_profiles()
    hw_options.configure(config)  # the hardware tier's options, checked before any test
    _vllm_server_settings(config)
    for marks in (TIERS, CADENCES, BACKEND_MARKS):
        for name, text in marks.items():
            config.addinivalue_line("markers", f"{name}: {text}")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line(
        "markers",
        "only_backends(*names): a conformance parametrization that applies to "
        "these backends only; it is not generated for the others (deselected)",
    )
    config.addinivalue_line(
        "markers",
        "requires_model(*traits): a conformance scenario that needs these model traits "
        "(bidir_kv.testing.families.TRAITS); not generated for families without them",
    )
    config.addinivalue_line(
        "markers",
        "kv_groups: a conformance scenario where more than one KV cache group matters "
        "(landing CI runs it on the hybrid model family too)",
    )
    if not os.environ.get(ledger.LEDGER_ENV) and not hasattr(config, "workerinput"):
        # every vLLM server this session (and the bench runs it starts) brings up is
        # counted; xdist workers and child processes inherit the variable
        out = REPO_ROOT / "out" / f"server-starts-{os.getpid()}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)
        os.environ[ledger.LEDGER_ENV] = str(out)
        config.stash[_LEDGER] = out


def _vllm_server_settings(config: pytest.Config) -> None:
    """``--vllm-executor`` / ``--nixl-progress-delay-us`` (else the variables, else the
    tiers' defaults) into the environment every vllm-cpu server of the session reads."""
    executor = config.getoption("--vllm-executor") or os.environ.get(EXECUTOR_ENV)
    os.environ[EXECUTOR_ENV] = executor or TEST_EXECUTOR
    delay = config.getoption("--nixl-progress-delay-us")
    if delay is not None and delay < 0:
        raise pytest.UsageError(f"--nixl-progress-delay-us must be >= 0, got {delay}")
    if delay is not None:
        os.environ[PTHR_DELAY_ENV] = str(delay)
    elif TEST_NIXL_DELAY_US is not None:
        os.environ.setdefault(PTHR_DELAY_ENV, str(TEST_NIXL_DELAY_US))


_LEDGER = pytest.StashKey[Path]()
_IDENT = re.compile(r"(?:\w|:|\+|-|\.|\[|\]|\\|/)+")


def _tier_of(path: Path) -> str | None:
    parts = path.parts
    if "suites" in parts:
        idx = parts.index("suites")
        if idx + 1 < len(parts) and parts[idx + 1] in TIERS:
            return parts[idx + 1]
    return None


def excludes_tier(markexpr: str, tier: str) -> bool:
    """Whether ``-m markexpr`` can select no test of scope ``tier``, whatever other marks
    its tests carry: every assignment of the expression's other names is tried (scope
    marks come from the folder alone, so this is exact). False when unsure."""
    try:
        from _pytest.mark.expression import Expression

        expr = Expression.compile(markexpr)
    except (ImportError, SyntaxError):
        return False
    reserved = {"and", "or", "not", "True", "False", "None"}
    others = sorted({w for w in _IDENT.findall(markexpr) if w not in reserved} - set(TIERS))
    if len(others) > 10:
        return False
    for bits in range(2 ** len(others)):
        value = {name: bool(bits >> i & 1) for i, name in enumerate(others)}
        try:
            if expr.evaluate(functools.partial(_assigned, tier, value)):
                return False
        except Exception:  # an expression form this check does not know: collect
            return False
    return True


def _assigned(tier: str, value: dict[str, bool], name: str, /, **kwargs: object) -> bool:
    """``-m``'s matcher for :func:`excludes_tier`: the scope marks of a test in ``tier``,
    the other names as ``value`` assigns them."""
    if name in TIERS:
        return name == tier and not kwargs
    return value.get(name, False)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """``pytest -m unit`` (as the README types it) does not import the other tiers'
    modules: a ``suites/<scope>/`` folder whose scope the ``-m`` expression excludes is
    not collected (they would all be deselected)."""
    markexpr = config.getoption("markexpr", "")
    if not markexpr:
        return None
    tier = _tier_of(collection_path)
    if tier is not None and excludes_tier(markexpr, tier):
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Scope from the folder (suites/<tier>/...), cadence (pre_merge unless nightly),
    and the backend marks (docs/testing.md)."""
    wrong = []
    for item in items:
        tier = _tier_of(Path(str(item.fspath)))
        marked = {name for name in TIERS if item.get_closest_marker(name) is not None}
        if tier is not None:
            if marked - {tier}:
                wrong.append(f"{item.nodeid}: marked {sorted(marked - {tier})}, lives in {tier}")
            item.add_marker(getattr(pytest.mark, tier))
        nightly = item.get_closest_marker("nightly") is not None
        if item.get_closest_marker("pre_merge") is not None and nightly:
            wrong.append(f"{item.nodeid}: marked both pre_merge and nightly")
        if not nightly:
            item.add_marker(pytest.mark.pre_merge)
        callspec = getattr(item, "callspec", None)
        backend = callspec.params.get("pd") if callspec is not None else None
        # a str: "vllm-cpu@hybrid", the backend's mark (families.py); anything else is
        # pytest's placeholder of a scenario no selected backend runs (deselected by the
        # conformance plugin)
        if isinstance(backend, str):
            item.add_marker(getattr(pytest.mark, backend_mark(split_backend_id(str(backend))[0])))
        if tier == "hardware" or any(item.get_closest_marker(m) for m in VLLM_MARKS):
            item.add_marker(pytest.mark.vllm)
    if wrong:
        raise pytest.UsageError(
            "markers contradict the suite layout (docs/testing.md):\n  " + "\n  ".join(wrong)
        )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many vLLM servers the session started, and what they cost (the start ledger,
    bidir_kv/launch/ledger.py); nothing when it started none."""
    path = terminalreporter.config.stash.get(_LEDGER, None)
    lines = ledger.read(path) if path is not None else []
    starts = ledger.starts(lines)
    if not starts:
        return
    tr = terminalreporter
    waited = sum(float(s["seconds"]) for s in starts)
    cpu = sum(float(s.get("cpu_seconds") or 0) for s in lines if s["kind"] == "stop")
    tr.write_sep(
        "-",
        f"vLLM servers started: {len(starts)}, {waited:.0f} s until /health, "
        f"{cpu:.0f} CPU-s used by the servers stopped",
    )
    by_test: dict[str, list[dict[str, Any]]] = {}
    for s in starts:
        by_test.setdefault(str(s["test"]) or "(outside a test)", []).append(s)
    for test, rows in by_test.items():
        kinds = ", ".join(f"{r['kind']} {r['name']} {float(r['seconds']):.0f} s" for r in rows)
        tr.write_line(f"{test}: {kinds}")
    tr.write_line(f"(ledger: {path})")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test expected to fail (``xfail``: a conformance pin) whose injected fault did not
    take effect fails instead (bidir_kv/testing/faults.py): it showed nothing about the
    defect. Runs around pytest's own xfail handling (``tryfirst``: the outermost
    wrapper), so it sees the report after an expected failure became ``xfailed``."""
    rep = yield
    if (
        call.excinfo is not None
        and call.excinfo.errisinstance(FaultNotApplied)
        and hasattr(rep, "wasxfail")
    ):
        rep.outcome = "failed"
        del rep.wasxfail
    return rep


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """``async def`` tests (``anyio_mode = "auto"`` in pyproject.toml) run on asyncio, the
    loop the engine and router serve on; one backend, so test ids carry no backend name."""
    return "asyncio"


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    """A per-test folder for node logs and outputs."""
    d = tmp_path / "run"
    d.mkdir()
    yield d
