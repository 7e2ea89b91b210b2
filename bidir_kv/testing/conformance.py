"""Pytest plugin for the conformance tier: backend selection and the fixtures scenarios use.

Loaded by ``bidir_kv.testing.plugin``. A scenario is one test function taking the
``pd`` fixture; it is parametrized over the selected backends (``--backend``,
default: emulator, vllm-cpu and vllm-cpu+bidir-kv, plus external when ``--prefill-url``
is given) and, on the vLLM backends, over the model families (``--model-family``,
:mod:`bidir_kv.testing.families`; ids ``vllm-cpu`` for the dense family,
``vllm-cpu@hybrid`` for another), skipping the families a scenario cannot apply to
(``requires_model``). The vLLM release is one per session (``--vllm-version``, the
environment ``make conformance-env VLLM_VERSION=X`` built).
One backend is up at a time (session scope; pytest groups tests by backend).

Known upstream defects are pinned per backend and release in
:mod:`bidir_kv.testing.exemptions` (``xfail(strict=True)``). Outcomes go into the
matrix (:mod:`bidir_kv.testing.matrix`), written as Markdown and JSON to
``--conformance-report`` (``out/conformance``); ``bidir-kv conformance-report`` merges
the runs of several releases into one compatibility report (:mod:`bidir_kv.report.compat`).
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.launch.process import ManagedProcess, ProcessFailed, free_port, wait_http_ok
from bidir_kv.paths import REPO_ROOT
from bidir_kv.policy import cache_ttl_below_retention
from bidir_kv.testing import matrix
from bidir_kv.testing.backend_start import UnsupportedRelease, start_backend
from bidir_kv.testing.backends import PDBackend, PromptFactory
from bidir_kv.testing.exemptions import exemption_for
from bidir_kv.testing.families import (
    DEFAULT_FAMILY,
    FAMILIES,
    backend_id,
    family_named,
    split_backend_id,
)
from bidir_kv.testing.gating import skip_or_fail
from bidir_kv.testing.matrix import backend_release
from bidir_kv.testing.router import start_router_process
from bidir_kv.topology.base import BackendUnavailable

__all__ = [
    "prompt_seed",
    "selected_backends",
    "selected_families",
    "selected_proxies",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("bidir-kv conformance")
    g.addoption(
        "--conformance-report",
        default=str(REPO_ROOT / "out" / "conformance"),
        help="directory for matrix.md / matrix.json and backend logs",
    )
    g.addoption(
        "--vllm-compiled",
        action="store_true",
        help="vllm-cpu: use torch.compile instead of --enforce-eager (slower start)",
    )
    g.addoption(
        "--vllm-version",
        default=None,
        metavar="RELEASE",
        help="vllm-cpu backends: the vllm-cpu release to run (default: the pinned "
        "release); its environment comes from `make conformance-env VLLM_VERSION=RELEASE`",
    )
    g.addoption(
        "--model-family",
        action="append",
        default=None,
        metavar="FAMILY",
        help="vllm-cpu backends: model families to run the catalogue on (repeatable; "
        f"{', '.join(FAMILIES)} or all; default {DEFAULT_FAMILY})",
    )
    g.addoption(
        "--scenarios-only",
        action="store_true",
        help="run the scenario catalogue only (tests taking the pd fixture): a release's "
        "matrix run, without the checks of the pinned environment and our connector's classes",
    )
    g.addoption(
        "--emulate-vllm",
        default="0.32",
        choices=("0.32", "0.33"),
        help="emulator backend: vLLM version to behave as (default 0.32, like vllm-cpu)",
    )
    g.addoption(
        "--reference-url",
        default=None,
        help="external backend: a non-disaggregated server for reference outputs "
        "(default: P with a fresh cache_salt)",
    )
    g.addoption(
        "--external-version",
        default="0.33",
        choices=("0.32", "0.33"),
        help="external backend: vLLM version of the deployment",
    )
    g.addoption(
        "--external-block-size",
        type=int,
        default=None,
        help="external backend: the engines' block size (default 128 on CPU, 16 on GPU; pass it)",
    )
    g.addoption(
        "--external-threshold",
        type=int,
        default=None,
        help="external backend: kv_recompute_threshold on P (default 64)",
    )
    g.addoption(
        "--external-decoder-ttl",
        type=float,
        default=None,
        help="external backend: decoder_kv_blocks_ttl on D (default 480)",
    )


def selected_backends(config: pytest.Config) -> list[str]:
    """Backends in run order. vllm-cpu goes first: pytest groups tests by this
    session-scoped parameter and tears an instance down only when the next one is set
    up, so the last backend lives until the session ends. A real vLLM pair keeps both
    cores busy while it holds blocks; it must be gone before the other tiers run."""
    chosen = config.getoption("--backend")
    if chosen:
        out = list(dict.fromkeys(chosen))
    else:
        # stock vLLM beside vLLM with our connector: the matrix shows each scenario
        # that is a pinned defect on one and passes on the other (docs/connector.md)
        out = ["emulator", "vllm-cpu", "vllm-cpu+bidir-kv"]
        if config.getoption("--prefill-url"):
            out.append("external")
    return sorted(out, key=lambda name: not name.startswith("vllm-cpu"))


def selected_families(config: pytest.Config) -> list[str] | None:
    """Model families the vLLM backends run the catalogue on (``--model-family``);
    ``None`` when not given: the default matrix of :func:`_pd_ids`."""
    chosen = config.getoption("--model-family")
    if not chosen:
        return None
    if "all" in chosen:
        return list(FAMILIES)
    try:
        return [family_named(name).name for name in dict.fromkeys(chosen)]
    except ValueError as exc:
        raise pytest.UsageError(f"--model-family: {exc}") from None


# Landing CI's matrix when --model-family is not given: the dense family everywhere, and
# the hybrid family on stock vLLM for the scenarios where KV cache groups matter
# (``kv_groups``); every family on every vLLM backend is the nightly compat workflow's.
DEFAULT_GROUPS_FAMILY, DEFAULT_GROUPS_BACKENDS = "hybrid", ("vllm-cpu",)


def _pd_ids(metafunc: pytest.Metafunc) -> list[str]:
    """``pd`` ids of one scenario: each backend, and on the vLLM backends each selected
    family the scenario applies to (``requires_model``); the emulator and an external
    deployment run the dense family only."""
    needs: set[str] = set()
    for mark in metafunc.definition.iter_markers("requires_model"):
        needs |= set(mark.args)
    chosen = selected_families(metafunc.config)
    groups_matter = metafunc.definition.get_closest_marker("kv_groups") is not None
    ids = []
    for backend in selected_backends(metafunc.config):
        vllm = backend.startswith("vllm-cpu")
        if chosen is not None:
            families = chosen if vllm else [f for f in chosen if f == DEFAULT_FAMILY]
        else:
            families = [DEFAULT_FAMILY]
            if groups_matter and backend in DEFAULT_GROUPS_BACKENDS:
                families.append(DEFAULT_GROUPS_FAMILY)
        ids += [backend_id(backend, f) for f in families if FAMILIES[f].has(needs)]
    return ids


def selected_proxies(config: pytest.Config) -> list[str]:
    """Routers the through-router scenarios run through: ours, plus ``--proxy-cmd``
    ("cmd") and ``--proxy-url`` ("url") when given."""
    out = ["bidir-kv"]
    if config.getoption("--proxy-cmd"):
        out.append("cmd")
    if config.getoption("--proxy-url"):
        out.append("url")
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "pd" in metafunc.fixturenames:
        names = _pd_ids(metafunc)
        metafunc.parametrize("pd", names, indirect=True, scope="session", ids=names)
    if "proxy" in metafunc.fixturenames:
        metafunc.parametrize("proxy", selected_proxies(metafunc.config))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _deselect_not_generated(config, items)
    _deselect_other_backends(config, items)
    if config.getoption("--scenarios-only"):
        keep = [i for i in items if _backend_of(i) is not None or not matrix.in_tier(i)]
        if len(keep) < len(items):
            config.hook.pytest_deselected(items=[i for i in items if i not in keep])
            items[:] = keep
    for item in items:
        value = _backend_of(item)
        if value is None:
            continue
        backend, family = split_backend_id(value)
        scenario = getattr(item, "originalname", item.name)
        callspec = getattr(item, "callspec", None)
        params = dict(callspec.params) if callspec is not None else {}
        release = backend_release(config, backend)
        pin = exemption_for(scenario, backend, params, release, family)
        if pin is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason=pin.xfail_reason))


def _deselect_not_generated(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A scenario no selected backend and family runs (e.g. one that needs several KV
    cache groups, with only the emulator selected) got no ``pd`` id: pytest's
    empty-parameter placeholder is deselected, not reported as a skip."""
    drop = [i for i in items if _pd_placeholder(i)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if not _pd_placeholder(i)]


def _pd_placeholder(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return (
        callspec is not None
        and "pd" in callspec.params
        and not isinstance(callspec.params["pd"], str)
    )


def _deselect_other_backends(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A parametrization marked ``only_backends(...)`` exists for those backends only:
    on the others it is deselected, not generated and skipped."""
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("only_backends")
        value = _backend_of(item)
        backend = split_backend_id(value)[0] if value is not None else None
        if mark is not None and backend is not None and backend not in mark.args:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _backend_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    value = callspec.params.get("pd")
    return str(value) if value is not None else None


# ---- the matrix report ------------------------------------------------------------


def _report_dir(config: pytest.Config) -> Path:
    return Path(config.getoption("--conformance-report"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    outcome = yield
    if matrix.in_tier(item):
        matrix.record(item, outcome.get_result())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    matrix.write(session.config, _report_dir(session.config))


# ---- fixtures ---------------------------------------------------------------------


@pytest.fixture
def router(request: pytest.FixtureRequest, pd: PDBackend, proxy: str) -> Iterator[str]:
    """URL of the router a through-router scenario talks to, in front of ``pd``.

    ``bidir-kv``: our proxy, started for the test. ``cmd``: the ``--proxy-cmd`` template
    filled with this backend's addresses and started for the test (ready when its port
    answers HTTP at all). ``url``: the running ``--proxy-url``, for the external backend
    only (a running router cannot be pointed at a backend started here).
    """
    cfg = request.config
    if proxy == "url":
        if pd.name != "external":
            pytest.skip("--proxy-url fronts the external deployment, not a local backend")
        yield str(cfg.getoption("--proxy-url")).rstrip("/")
        return
    p, d, kv = pd.prefill.node, pd.decode.node, pd.config
    port = free_port()
    cache_ttl = cache_ttl_below_retention(kv.decoder_ttl, margin=10.0)
    if proxy == "bidir-kv":
        extra = [
            "--cache-ttl",
            str(cache_ttl),
            "--decoder-kv-blocks-ttl",
            str(kv.decoder_ttl),
        ]  # no --block-size: the router learns it from the nodes (test_oracle checks)
        if not pd.streams_params:
            extra += ["--decode-stream", "never"]
        ours = start_router_process(
            pd.run_dir,
            [(p.host, p.port)],
            [(d.host, d.port)],
            extra,
            port=port,
            name=f"router-bidir-kv-{pd.name}",
            timeout=120,
            ready_path="/health",
        )
        try:
            yield ours.url
        finally:
            ours.proc.stop()
        return
    fields = {
        "python": sys.executable,
        "port": port,
        "prefill_host": p.host,
        "prefill_port": p.port,
        "decode_host": d.host,
        "decode_port": d.port,
        "block_size": kv.block_size,
        "decoder_ttl": kv.decoder_ttl,
        "cache_ttl": cache_ttl,
    }
    template = str(cfg.getoption("--proxy-cmd"))
    try:
        argv = shlex.split(template.format(**fields))
    except (KeyError, IndexError, ValueError) as exc:
        pytest.fail(
            f"--proxy-cmd {template!r} is unusable: {exc!r} (placeholders: "
            f"{', '.join(sorted(fields))})",
            pytrace=False,
        )
    log = pd.run_dir / f"router-cmd-{pd.name}-{port}.log"
    proc = ManagedProcess("router-cmd", argv, log).start()
    try:
        # a foreign router may have no health route: any HTTP answer means it serves
        wait_http_ok(f"http://127.0.0.1:{port}/", 120, alive=proc, any_status=True)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def pd(request: pytest.FixtureRequest) -> Iterator[PDBackend]:
    """The started backend for this parametrization (one per session, backend and model
    family)."""
    value = str(request.param)
    name, family = split_backend_id(value)
    cfg = request.config
    options: dict[str, Any] = {
        "family": family,
        "release": backend_release(cfg, name),
        "compiled": cfg.getoption("--vllm-compiled"),
        "emulate_vllm": cfg.getoption("--emulate-vllm"),
        "prefill_url": cfg.getoption("--prefill-url"),
        "decode_url": cfg.getoption("--decode-url"),
        "proxy_url": cfg.getoption("--proxy-url"),
        "reference_url": cfg.getoption("--reference-url"),
        "version": cfg.getoption("--external-version"),
        "block_size": cfg.getoption("--external-block-size"),
        "threshold": cfg.getoption("--external-threshold"),
        "decoder_ttl": cfg.getoption("--external-decoder-ttl"),
    }
    t0 = time.monotonic()
    backends = matrix.matrix_of(cfg).backends
    try:
        backend = start_backend(name, _report_dir(cfg), options)
    except UnsupportedRelease as exc:
        # not missing infrastructure: the backend does not claim this release
        backends[value] = {"unsupported": str(exc), "release": options["release"]}
        pytest.skip(f"{value}: {exc}")
    except BackendUnavailable as exc:
        backends[value] = {"unavailable": str(exc)}
        skip_or_fail(cfg, "conformance", f"{value} backend unavailable: {exc}")
    except ProcessFailed as exc:
        backends[value] = {"failed_to_start": str(exc)[-2000:]}
        pytest.fail(f"{value} backend failed to start: {exc}", pytrace=False)
    backend.description["start_seconds"] = round(time.monotonic() - t0, 1)
    # probed now, while the pair is free: a scenario that pauses it (a pair variant)
    # may ask later (bidir_kv.testing.features)
    try:
        backend.description["streams_params"] = backend.streams_params
    except Exception:
        backend.close()
        raise
    backends[value] = backend.description
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture(autouse=True)
def _main_pair_runs(request: pytest.FixtureRequest) -> None:
    """A scenario starts with its backend's main pair running (a server beside it that an
    earlier scenario used is paused: bidir_kv/testing/pairs.py)."""
    if "pd" in request.fixturenames:
        backend: PDBackend = request.getfixturevalue("pd")
        if backend.pairs is not None:
            backend.pairs.use_main()


@pytest.fixture
def prompts(request: pytest.FixtureRequest) -> PromptFactory:
    """Token-id prompts unique to this test (same sequence on every backend)."""
    return PromptFactory(prompt_seed(request.node))


def prompt_seed(node: Any) -> str:
    """The test's id without the backend: the same prompts on every backend, different
    ones in every other scenario (so no scenario starts on another one's cached prefix)."""
    seed = f"{node.module.__name__}::{getattr(node, 'originalname', node.name)}"
    callspec = getattr(node, "callspec", None)
    params = dict(callspec.params) if callspec is not None else {}
    extra = [f"{k}={v}" for k, v in sorted(params.items()) if k != "pd"]
    return seed + "|" + ",".join(extra)
