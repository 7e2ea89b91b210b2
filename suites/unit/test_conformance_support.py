"""Unit checks of the conformance tier's support code (no processes started)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from bidir_kv.testing.backends import BACKEND_CONFIG, PromptFactory
from bidir_kv.testing.conformance import prompt_seed
from bidir_kv.testing.exemptions import (
    EXEMPTIONS,
    STREAM_PARAMS,
    Defect,
    Exemption,
    Releases,
    Upstream,
    exemption_for,
    release_key,
)
from bidir_kv.testing.plugin import BACKENDS
from bidir_kv.topology.base import BackendUnavailable, EngineSpec, TopologySpec
from bidir_kv.topology.external import ExternalTopology, parse_node_url
from bidir_kv.topology.vllm_cpu import VllmCpuOptions, VllmCpuTopology, unavailable_reason


def test_prompt_factory_is_seeded_by_test_and_unique_per_call() -> None:
    a, b = PromptFactory("t::x"), PromptFactory("t::x")
    assert a.prompt(50) == b.prompt(50)
    assert a.prompt(50) != a.tokens(50)
    assert PromptFactory("t::y").prompt(50) != PromptFactory("t::x").prompt(50)
    assert all(5 <= t < 1000 for t in a.tokens(500))


def test_prompt_seed_ignores_backend_and_tells_parameters_apart() -> None:
    from types import SimpleNamespace

    def node(pd: str, n: int) -> SimpleNamespace:
        return SimpleNamespace(
            module=SimpleNamespace(__name__="suites.x"),
            name=f"test_a[{pd}-{n}]",
            originalname="test_a",
            callspec=SimpleNamespace(params={"pd": pd, "n": n}),
        )

    first = prompt_seed(node("emulator", 1))
    assert first == prompt_seed(node("vllm-cpu", 1)) == "suites.x::test_a|n=1"
    assert prompt_seed(node("vllm-cpu", 2)) != first


def test_exemption_matches_only_its_parametrization() -> None:
    ex = Exemption("r", "e", params=(("policy", "recompute"),))
    assert ex.matches({"policy": "recompute", "pd": "vllm-cpu"})
    assert not ex.matches({"policy": "fail"})
    assert Exemption("r", "e").matches({})


def test_every_exemption_names_its_defect_upstream_or_how_to_file_it() -> None:
    """Every pin names an upstream issue/PR, or its defect says what, where in vLLM and
    how to reproduce; every pin says which releases it holds for."""
    for (scenario, backend), exs in EXEMPTIONS.items():
        assert scenario.startswith("test_") and backend in BACKENDS
        for ex in exs:
            assert ex.evidence.strip(), scenario
            assert ex.defect is not None, f"{scenario}: a pin without its defect"
            d = ex.defect
            if d.upstream.kind == "unfiled":
                assert "vllm/" in d.what or "_" in d.what, f"{d.key}: where in vLLM?"
                assert "pytest suites/conformance/" in d.reproduce, d.key
            else:
                assert d.upstream.number and d.upstream.url and str(d.upstream.number) in d.what
            assert str(d.releases) in ex.xfail_reason and d.upstream.label in ex.xfail_reason


def test_release_ranges_hold_by_release_number() -> None:
    r = Releases("0.21.0", "0.32.0")
    assert r.holds_for("0.21.0") and r.holds_for("0.29.0") and r.holds_for("0.32.0+cpu")
    assert not r.holds_for("0.33.0") and not r.holds_for("0.20.2")
    assert r.holds_for("0.100.0") is False and Releases("0.29.0").holds_for("0.100.0")
    assert Releases("0.29.0").holds_for(None)  # the emulator and unknown deployments
    assert release_key("0.9.1") < release_key("0.10.0")  # numbers, not strings
    with pytest.raises(ValueError, match="empty"):
        Releases("0.32.0", "0.29.0")
    with pytest.raises(ValueError, match="release number"):
        release_key("latest")


def test_exemption_for_is_keyed_by_release_and_family() -> None:
    pin = exemption_for("test_d_node_params", "vllm-cpu", {"stream": True}, "0.29.0")
    assert pin is not None and pin.defect is STREAM_PARAMS
    assert "vLLM PR #40186; releases 0.21.0-0.32.0" in pin.xfail_reason
    assert exemption_for("test_d_node_params", "vllm-cpu", {"stream": False}, "0.29.0") is None
    assert exemption_for("test_d_node_params", "vllm-cpu", {"stream": True}, "0.33.0") is None
    only_moe = Exemption("r", "e", defect=STREAM_PARAMS, families=("moe",))
    assert only_moe.matches({}, "0.29.0", "moe") and not only_moe.matches({}, "0.29.0", "dense")


def test_an_unfiled_defect_must_say_how_to_reproduce() -> None:
    with pytest.raises(ValueError, match="how to reproduce"):
        Defect("x", Upstream("unfiled"), Releases("0.32.0"), "what")
    with pytest.raises(ValueError, match="number"):
        Upstream("pr")


@pytest.mark.parametrize(
    "url, problem",
    [
        ("localhost:8000", "not an http"),
        ("http://h:80/v1", "has a path"),
        ("http://h:99999", "invalid port"),
    ],
)
def test_external_urls_are_checked(url: str, problem: str) -> None:
    with pytest.raises(BackendUnavailable, match=problem):
        parse_node_url(url, "prefill", "prefill-0")


def test_external_needs_both_urls() -> None:
    with pytest.raises(BackendUnavailable, match="--prefill-url and --decode-url"):
        ExternalTopology(["http://p:1"], [])
    node = parse_node_url("http://10.0.0.1:8100", "prefill", "p")
    assert node.url == "http://10.0.0.1:8100"


def test_vllm_cpu_command_line_and_environment(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    venv = tmp_path / "venv"
    spec = EngineSpec(
        kv=BACKEND_CONFIG.kv("prefill", "p-1"), enable_prefix_caching=False, max_model_len=32768
    )
    topo = VllmCpuTopology(
        TopologySpec(prefill=spec, decode=spec),
        VllmCpuOptions(venv=venv, model=model, log_dir=tmp_path),
    )
    argv = topo.argv("prefill", spec, 8100, "p-1")
    assert argv[:3] == [str(venv / "bin" / "vllm"), "serve", str(model)]
    assert argv[argv.index("--max-model-len") + 1] == "4096"  # capped by the model
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" in argv
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_producer" and kv["kv_buffer_device"] == "cpu"
    assert kv["engine_id"] == "p-1"
    assert kv["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
    assert (
        json.loads(
            topo.argv("decode", spec, 8200, "d-1")[
                topo.argv("decode", spec, 8200, "d-1").index("--kv-transfer-config") + 1
            ]
        )["kv_role"]
        == "kv_consumer"
    )
    env = topo.env(1, 5700, spec)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5700"
    site = Path(env["PYTHONPATH"].split(":")[0])
    assert (site / "sitecustomize.py").is_file()


def test_vllm_cpu_unavailable_reason_names_the_missing_piece(tmp_path: Path) -> None:
    reason = unavailable_reason(tmp_path / "nope", tmp_path)
    assert reason is not None
    assert "make conformance-env" in reason or "x86_64" in reason


def test_an_unusable_client_fails_fast_naming_why() -> None:
    from bidir_kv.client import TransportError
    from bidir_kv.testing.pd_client import EngineClient
    from bidir_kv.topology.base import Node

    # port 9 (discard) on loopback: nothing is sent while the client is unusable
    client = EngineClient(Node(role="prefill", name="prefill-0", host="127.0.0.1", port=9))
    with client.unusable("paused while the P variant 'x' runs"):
        with pytest.raises(RuntimeError, match="prefill-0 cannot be used here: paused"):
            client.complete([5, 6, 7], 1)
        with pytest.raises(RuntimeError, match="paused while the P variant"):
            client.metrics()
    with pytest.raises(TransportError):  # usable again: a real request, refused
        client.complete([5, 6, 7], 1, timeout=2)


def test_vllm_cpu_process_names_a_node_it_does_not_run(tmp_path: Path) -> None:
    topo = VllmCpuTopology(
        TopologySpec(prefill=EngineSpec(), decode=EngineSpec()), VllmCpuOptions(log_dir=tmp_path)
    )
    with pytest.raises(ValueError, match="prefill-0 is not a running server"):
        topo.process("prefill-0")


def _load_site_fixes() -> ModuleType:
    """The servers' sitecustomize, loaded under another name so it installs nothing."""
    from bidir_kv.topology.vllm_cpu import SITE_FIXES

    spec = importlib.util.spec_from_file_location(
        "bidir_kv_site_fixes", SITE_FIXES / "sitecustomize.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kv_cores_are_limited_to_the_allowed_cpus() -> None:
    site = _load_site_fixes()
    assert site.within_allowed([[0, 1], [2, 3], [4]], {1, 2, 3}) == [[1], [2, 3]]
    assert site.within_allowed([[0, 1]], {5}) == []  # no node left: vLLM sets no affinity


def test_the_kv_core_fix_patches_the_platform_module_when_it_is_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook waits for the module's own import (vLLM PR #32365 picks host cores)."""
    site = _load_site_fixes()
    allowed = sorted(os.sched_getaffinity(0))
    host = [*allowed, max(allowed) + 1000]  # the host has a core this process may not use
    pkg = tmp_path / "fakevllm"
    (pkg / "platforms").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "platforms" / "__init__.py").write_text("")
    (pkg / "platforms" / "cpu.py").write_text(
        "class CpuPlatform:\n"
        "    @classmethod\n"
        f"    def discover_numa_topology(cls):\n        return [{host!r}]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        sys,
        "meta_path",
        [site.PatchOnImport("fakevllm.platforms.cpu", site.limit_kv_cores), *sys.meta_path],
    )
    for name in ("fakevllm", "fakevllm.platforms", "fakevllm.platforms.cpu"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    cpu = importlib.import_module("fakevllm.platforms.cpu")
    assert cpu.CpuPlatform.discover_numa_topology() == [allowed]


def test_the_kv_core_fix_says_when_it_finds_nothing_to_patch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    site = _load_site_fixes()
    site.limit_kv_cores(ModuleType("vllm.platforms.cpu"))
    assert "no discover_numa_topology" in capsys.readouterr().err


def test_nixl_agents_get_the_progress_thread_delay_when_their_binding_is_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fix 3: every agent the binding builds carries ``pthrDelay`` (NIXL's Python API sets
    0); the API module, which reads ``nixlAgent`` from the binding at call time, is
    untouched."""
    site = _load_site_fixes()
    pkg = tmp_path / "fakenixl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_bindings.py").write_text(
        "class nixlAgentConfig:\n    pthrDelay = 0\n"
        "class nixlAgent:\n"
        "    def __init__(self, name, config):\n"
        "        self.name, self.delay = name, config.pthrDelay\n"
    )
    (pkg / "_api.py").write_text(
        "from . import _bindings as nixlBind\n"
        "def agent(name):\n"
        "    cfg = nixlBind.nixlAgentConfig()\n"
        "    cfg.pthrDelay = 0\n"
        "    return nixlBind.nixlAgent(name, cfg)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        sys,
        "meta_path",
        [
            site.PatchOnImport(
                ("fakenixl._bindings",), lambda m: site.delay_progress_thread(m, 100)
            ),
            *sys.meta_path,
        ],
    )
    for name in ("fakenixl", "fakenixl._bindings", "fakenixl._api"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    api = importlib.import_module("fakenixl._api")
    agent = api.agent("p")
    assert (agent.name, agent.delay) == ("p", 100)


_TREE = """
import ctypes, os, subprocess, sys
cpu = min(os.sched_getaffinity(0))
child = subprocess.Popen([sys.executable, "-c", '''
import ctypes, os, sys
ctypes.CDLL(None).prctl(15, b"VLLM::Worker", 0, 0, 0)  # PR_SET_NAME, as vLLM's workers
os.sched_setaffinity(0, {%d})
print(os.getpid(), flush=True)
sys.stdin.read()
''' % cpu], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), cpu, flush=True)
sys.stdin.read()
child.stdin.close(); child.wait()
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_worker_cpus_finds_vllm_workers_below_a_server_and_their_cores() -> None:
    """What the launcher checks after start-up: where each worker's main thread may run."""
    import subprocess

    from bidir_kv.topology.vllm_cpu import worker_cpus

    server = subprocess.Popen(
        [sys.executable, "-c", _TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        worker, cpu = (int(x) for x in server.stdout.readline().split())
        assert worker_cpus(server.pid) == {worker: {cpu}}
        assert worker_cpus(worker) == {worker: {cpu}}  # the worker itself counts too
        server.communicate(timeout=20)  # EOF: the server ends its worker, then itself
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
    assert worker_cpus(server.pid) == {}  # gone: nothing to report
