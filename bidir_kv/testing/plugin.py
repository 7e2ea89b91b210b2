"""The one pytest plugin: options, markers, tier marks, and the fixture modules it loads.

The root ``conftest.py`` loads this module; it registers the fixture and hook modules
listed in :data:`pytest_plugins`, so suites never import fixtures (and never import
each other). Tier gating (``skip_or_fail``) lives in :mod:`bidir_kv.testing.gating`.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from bidir_kv.testing.faults import FaultNotApplied
from bidir_kv.testing.gating import REQUIRE_ENV

TIERS = {
    "unit": "pure, in-process tests; laptops, seconds",
    "integration": "emulated P/D topologies as processes or containers",
    "conformance": "backend-agnostic scenarios (emulator, real vLLM on CPU, external)",
    "hardware": "real NIXL on GPU/EFA; OFF/ON TTFT rounds and the release gates",
}
BACKENDS = ("emulator", "vllm-cpu", "vllm-cpu+bidir-kv", "external")
_REPO = Path(__file__).resolve().parents[2]

# Fixture and hook modules, registered by pytest when it loads this plugin.
pytest_plugins = [
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
    _hardware_options(parser.getgroup("bidir-kv hardware"))
    group.addoption(
        "--require-tier",
        action="append",
        default=[],
        metavar="TIER",
        help="fail (instead of skip) when TIER's infrastructure is missing; "
        f"also read from {REQUIRE_ENV} (comma-separated)",
    )


def _hardware_options(g: pytest.OptionGroup) -> None:
    """The hardware tier's knobs (docs/hardware.md §3-§4)."""
    from bidir_kv.testing.hw_gates import DEFAULT_MAX_REGRESSION

    g.addoption(
        "--hw-prompt-tokens",
        default=None,
        help="history lengths to gate (default on GPU: the publication's "
        "2000,4000,8000,12000,16000,20000,24000, 2000,8000 with --hw-quick; "
        "1000,2000,3000 on vllm-cpu)",
    )
    g.addoption(
        "--hw-rounds",
        type=int,
        default=5,
        help="OFF/ON rounds per length when turn 2 alone is measured (vllm-cpu)",
    )
    g.addoption(
        "--hw-quick",
        action="store_true",
        help="a smoke run on GPU: two lengths, one client with one 3-turn conversation",
    )
    g.addoption(
        "--hw-conversations",
        type=int,
        default=None,
        help="conversations per length (default on GPU 10; 1 with --hw-quick)",
    )
    g.addoption(
        "--hw-turns",
        type=int,
        default=None,
        help="turns per conversation, turns >= 2 measured (default on GPU 10; 3 with "
        "--hw-quick; 2 on vllm-cpu: turn 2 of --hw-rounds rounds)",
    )
    g.addoption(
        "--hw-clients",
        type=int,
        default=None,
        help="concurrent clients (default on GPU 2; 1 with --hw-quick)",
    )
    g.addoption(
        "--hw-answer-tokens",
        type=int,
        default=300,
        help="answer tokens per turn of a conversation (the publication's 300)",
    )
    g.addoption(
        "--hw-min-speedup",
        default=None,
        metavar="LEN=X,...",
        help="TTFT speedup bound per length (default: this run's calibration)",
    )
    g.addoption(
        "--hw-calibration-tolerance",
        type=float,
        default=0.3,
        help="calibrated bound = predicted speedup x (1 - tolerance)",
    )
    g.addoption(
        "--hw-line-rate-gbps",
        type=float,
        default=None,
        help="NIC line rate; gates transfer efficiency when given",
    )
    g.addoption(
        "--hw-min-line-share",
        type=float,
        default=0.5,
        help="least share of --hw-line-rate-gbps a transfer must reach",
    )
    g.addoption(
        "--hw-kv-bytes-per-token",
        type=float,
        default=None,
        help="KV bytes per token over the TP group (default: from the model config)",
    )
    g.addoption(
        "--hw-block-size",
        type=int,
        default=None,
        help="the engines' block size for a deployment by URL (default 16)",
    )
    g.addoption("--hw-threshold", type=int, default=64, help="P's kv_recompute_threshold")
    g.addoption("--hw-model", default=None, help="served model name of the deployment")
    g.addoption(
        "--hw-launch",
        action="store_true",
        help="start P and D here with `bidir-kv serve` and stop them after the tier",
    )
    g.addoption(
        "--hw-launcher",
        default=None,
        choices=("auto", "local", "ssh", "slurm", "kubernetes"),
        help="how P and D are placed: local (one host, no fabric), ssh (--hw-hosts; "
        "the dry run: two hosts made on this machine), slurm, kubernetes; default: "
        "local with --hw-launch, auto (ssh where two hosts can be made) for the dry run",
    )
    g.addoption(
        "--hw-hosts",
        default=None,
        metavar="P_HOST,D_HOST",
        help="--hw-launcher ssh: P's and D's hosts ([user@]host)",
    )
    g.addoption(
        "--hw-ssh-option",
        action="append",
        default=[],
        metavar="ARG",
        help="one more ssh client argument for the ssh launcher (repeatable), "
        "e.g. -F ~/.ssh/cluster_config",
    )
    g.addoption(
        "--hw-fabric",
        default="auto",
        metavar="auto|off|efa[:DEV,...]|if:NAME",
        help="P's NIC counters the fabric gate reads around the ON rounds (docs/hardware.md §4)",
    )
    g.addoption(
        "--hw-fabric-overhead",
        type=float,
        default=None,
        help="counted bytes may exceed the KV bytes by this factor "
        "(default 1.05 on EFA, 1.25 on an interface)",
    )
    g.addoption(
        "--hw-image",
        default="vllm/vllm-openai:latest",
        help="--hw-launcher kubernetes: the pods' image (vLLM with NIXL)",
    )
    g.addoption(
        "--hw-kube-api",
        default=None,
        help="--hw-launcher kubernetes: the API server URL (default: in-cluster)",
    )
    g.addoption(
        "--hw-kube-namespace",
        default="default",
        help="--hw-launcher kubernetes: the namespace of the pods",
    )
    g.addoption("--hw-launch-model", default=None, help="--hw-launch: the model to serve")
    g.addoption("--hw-p-gpus", default="0,1,2,3", help="--hw-launch: P's accelerators")
    g.addoption("--hw-d-gpus", default="4,5,6,7", help="--hw-launch: D's accelerators")
    g.addoption("--hw-nixl-backend", default="LIBFABRIC", choices=("LIBFABRIC", "UCX"))
    g.addoption("--hw-device", default="cuda", choices=("cuda", "neuron"))
    g.addoption("--hw-tp", type=int, default=4, help="--hw-launch: tensor parallel size")
    g.addoption(
        "--hw-launch-arg",
        action="append",
        default=[],
        help="--hw-launch: one more vllm serve argument (repeatable)",
    )
    g.addoption(
        "--hw-baseline",
        default=None,
        metavar="RUN",
        help="a run in --benchmark-storage (number, name glob or file) whose ON TTFT "
        "median and OFF/ON speedup per length this run must not regress from",
    )
    g.addoption(
        "--hw-max-regression",
        type=float,
        default=DEFAULT_MAX_REGRESSION,
        metavar="PERCENT",
        help="--hw-baseline: the largest regression allowed, in "
        f"percent (default {DEFAULT_MAX_REGRESSION:g})",
    )
    g.addoption(
        "--hw-report",
        default=str(_REPO / "out" / "hardware"),
        help="directory for the benchmark JSON, JUnit XML, report.md and plots",
    )


def _hypothesis_profile() -> None:
    """No per-example deadline: the machines are shared and noisy (a real vLLM pair may
    be idling beside the unit tier), and timing is never what a property asserts."""
    try:
        from hypothesis import settings
    except ImportError:
        return
    settings.register_profile("bidir-kv", deadline=None, database=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "bidir-kv"))


def pytest_configure(config: pytest.Config) -> None:
    _hypothesis_profile()
    for name, text in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line(
        "markers",
        "only_backends(*names): a conformance parametrization that applies to "
        "these backends only; it is not generated for the others (deselected)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test gets the marker of the tier folder it lives in (suites/<tier>/...)."""
    for item in items:
        parts = Path(str(item.fspath)).parts
        if "suites" in parts:
            idx = parts.index("suites")
            if idx + 1 < len(parts) and parts[idx + 1] in TIERS:
                item.add_marker(getattr(pytest.mark, parts[idx + 1]))


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
