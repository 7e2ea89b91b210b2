"""The wire version registry: every wire's version lives in ``bidir_kv/wire/versions.py``."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from bidir_kv.wire import versions
from bidir_kv.wire.params import (
    HeldTokens,
    advertises_verify,
    lease_to_wire,
    verifier_advert,
)

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "bidir_kv"
REGISTRY = PACKAGE / "wire" / "versions.py"


def test_each_wire_names_its_module_and_has_a_history_line_per_version() -> None:
    assert len({w.name for w in versions.WIRES}) == len(versions.WIRES)
    for wire in versions.WIRES:
        importlib.import_module(wire.where)
        assert wire.version == len(wire.history) >= 1
        assert all(line.strip() for line in wire.history), wire.name


def test_the_values_on_the_wire_carry_the_registry_versions() -> None:
    held = HeldTokens.of(list(range(10)), 4)
    assert held.to_wire()["v"] == versions.TOKEN_CHAIN.version
    assert lease_to_wire(30)["v"] == versions.LEASE.version
    assert verifier_advert()["v"] == versions.VERIFY.version


def test_the_verify_advert_is_recognised_only_at_its_version() -> None:
    assert advertises_verify({"bidir_kv_verify": verifier_advert()})
    assert not advertises_verify({"bidir_kv_verify": {"v": 99, "chain": True}})
    assert not advertises_verify({"bidir_kv_verify": {"v": versions.VERIFY.version}})
    assert not advertises_verify({"bidir_kv_fence": {"v": 1, "reads": True}})
    assert not advertises_verify(None)


def _int_version_constants(source: str) -> list[str]:
    """Module-level ``<NAME>_VERSION = <int>`` assignments: a version kept outside the
    registry."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            value = node.value.value
            if isinstance(value, int) and not isinstance(value, bool):
                found += [n for n in names if n.endswith("_VERSION")]
    return found


def test_no_wire_version_is_kept_outside_the_registry() -> None:
    stray = {
        str(path.relative_to(PACKAGE)): names
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != REGISTRY and (names := _int_version_constants(path.read_text(encoding="utf-8")))
    }
    assert not stray, f"wire versions outside bidir_kv/wire/versions.py: {stray}"


def test_the_stray_version_check_sees_a_planted_constant() -> None:
    assert _int_version_constants("WIRE_VERSION = 1\nNAME = 'x'\n") == ["WIRE_VERSION"]
    assert _int_version_constants('VLLM_CPU_VERSION = "0.32.0"\n') == []
