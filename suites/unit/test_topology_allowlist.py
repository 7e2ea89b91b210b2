"""Each topology gives its P and D a peer allowlist of their own peers
(``TopologySpec.peer_allowlist``, docs/connector.md §7), without starting anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bidir_kv.config import KVTransferConfig
from bidir_kv.testing.backends import BACKEND_CONFIG
from bidir_kv.topology.base import EngineSpec, TopologySpec
from bidir_kv.topology.container import ContainerTopology
from bidir_kv.topology.local import LocalTopology, engine_argv
from bidir_kv.topology.vllm_cpu import VllmCpuOptions, VllmCpuTopology
from bidir_kv.wire.fence import ALLOWLIST_CONFIG_KEY as ALLOW


def _spec(role: str, **extra: object) -> EngineSpec:
    return EngineSpec(kv=BACKEND_CONFIG.kv(role, f"{role}-engine-000", **extra))


def _pd(**over: object) -> TopologySpec:
    fields: dict[str, object] = {
        "prefill": _spec("prefill"),
        "decode": _spec("decode"),
        "routers": 0,
        **over,
    }
    return TopologySpec(**fields)  # type: ignore[arg-type]


def _listed(kv: KVTransferConfig) -> object:
    return kv.extra.get(ALLOW)


def test_local_lists_the_other_role_by_its_address(tmp_path: Path) -> None:
    topo = LocalTopology(_pd(num_decode=2), tmp_path)
    p, d = topo.engine_spec("prefill"), topo.engine_spec("decode")
    assert _listed(p.kv) == ["127.0.0.1"] and _listed(d.kv) == ["127.0.0.1"]
    kv = json.loads(
        engine_argv(p, 8100, "p")[engine_argv(p, 8100, "p").index("--kv-transfer-config") + 1]
    )
    assert kv["kv_connector_extra_config"][ALLOW] == ["127.0.0.1"]
    assert _listed(topo.spec.prefill.kv) is None  # the spec itself is not changed


@pytest.mark.parametrize("topo_kind", ["local", "container"])
def test_off_a_given_list_and_a_lone_p_are_left_alone(tmp_path: Path, topo_kind: str) -> None:
    def make(spec: TopologySpec) -> LocalTopology | ContainerTopology:
        return (LocalTopology if topo_kind == "local" else ContainerTopology)(spec, tmp_path)

    off = make(_pd(peer_allowlist=False))
    assert _listed(off.engine_spec("prefill").kv) is None
    assert _listed(off.engine_spec("decode").kv) is None
    given = make(_pd(prefill=_spec("prefill", **{ALLOW: ["10.1.0.0/16"]})))
    assert _listed(given.engine_spec("prefill").kv) == ["10.1.0.0/16"]  # the user's wins
    assert _listed(given.engine_spec("decode").kv) is not None  # D still gets its own
    # a P variant reads from a D it did not start: nothing to list, so nothing set
    lone = make(_pd(num_decode=0))
    assert _listed(lone.engine_spec("prefill").kv) is None


def test_containers_list_peers_by_engine_id(tmp_path: Path) -> None:
    """Container names are the peers' hosts; a name matches no entry, so engine ids."""
    topo = ContainerTopology(_pd(num_decode=2), tmp_path, image="unused")
    assert _listed(topo.engine_spec("prefill").kv) == ["decode-engine-000", "decode-engine-001"]
    assert _listed(topo.engine_spec("decode").kv) == ["prefill-engine-000"]


def _vllm(tmp_path: Path, spec: TopologySpec, host: str = "127.0.0.1") -> VllmCpuTopology:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return VllmCpuTopology(
        spec, VllmCpuOptions(venv=tmp_path / "venv", model=model, log_dir=tmp_path, host=host)
    )


def test_vllm_cpu_lists_the_other_role_on_its_host(tmp_path: Path) -> None:
    topo = _vllm(tmp_path, _pd(num_decode=2), host="198.18.0.1")
    # engine ids are made unique in plan order, as the servers are started
    assert topo.engine_ids() == {
        "prefill-0": "prefill-engine-000",
        "decode-0": "decode-engine-000",
        "decode-1": "decode-engine-000-decode-1",
    }
    p = topo.serve_spec("prefill", topo.spec.prefill, 1, "prefill-engine-000", 0, 2)
    assert p.peer_allowlist == ("198.18.0.1",)
    kv = topo.kv_config("decode", topo.spec.decode, "decode-engine-000")
    assert kv["kv_connector_extra_config"][ALLOW] == ["198.18.0.1"]
    off = _vllm(tmp_path, _pd(peer_allowlist=False))
    assert off.serve_spec("prefill", off.spec.prefill, 1, "p", 0, 2).peer_allowlist is None
    assert ALLOW not in off.kv_config("prefill", off.spec.prefill, "p")["kv_connector_extra_config"]
    given = _vllm(tmp_path, _pd(prefill=_spec("prefill", **{ALLOW: ["p-peer"]})))
    kv = given.kv_config("prefill", given.spec.prefill, "p")
    assert kv["kv_connector_extra_config"][ALLOW] == ["p-peer"]  # the user's, unclashed
