"""The wire version registry: every wire's version lives in ``bidir_kv/wire/versions.py``."""

from __future__ import annotations

import ast
import importlib

import pytest

from bidir_kv.paths import REPO_ROOT
from bidir_kv.policy import KVGroup
from bidir_kv.wire import versions
from bidir_kv.wire.params import (
    GROUPS_KEY,
    HeldTokens,
    advertises_verify,
    groups_of,
    groups_to_wire,
    lease_to_wire,
    verifier_advert,
)

pytestmark = pytest.mark.unit

PACKAGE = REPO_ROOT / "bidir_kv"
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
    assert groups_to_wire([KVGroup.full(16)])["v"] == versions.GROUPS.version


def test_the_verify_advert_is_recognised_only_at_its_version() -> None:
    assert advertises_verify({"bidir_kv_verify": verifier_advert()})
    assert not advertises_verify({"bidir_kv_verify": {"v": 99, "chain": True}})
    assert not advertises_verify({"bidir_kv_verify": {"v": versions.VERIFY.version}})
    assert not advertises_verify({"bidir_kv_fence": {"v": 1, "reads": True}})
    assert not advertises_verify(None)


def test_group_layout_round_trips_and_anything_else_is_no_layout() -> None:
    layout = (KVGroup.sliding(4096, 16), KVGroup.full(16), KVGroup("mamba", 16))
    assert groups_of({GROUPS_KEY: groups_to_wire(layout)}) == layout
    good = groups_to_wire(layout)
    for bad in (
        {**good, "v": 99},
        {**good, "groups": []},
        {**good, "groups": [{"kind": "full", "block_size": "16"}]},
        {**good, "groups": [{"kind": "full", "block_size": 16, "window": 8}]},
        {**good, "groups": [{"kind": "sliding_window", "block_size": 16}]},
        {**good, "groups": [{"kind": "full", "block_size": True}]},
        {**good, "groups": ["full"]},
        "full",
    ):
        assert groups_of({GROUPS_KEY: bad}) is None, bad
    assert groups_of({}) is None and groups_of(None) is None


def _int_version_constants(source: str) -> list[str]:
    """Module-level ``<NAME>_VERSION = <int>`` assignments: a version kept outside the
    registry."""
    found: list[str] = []
    if "_VERSION" not in source:  # nothing to find: no need to parse
        return found
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


def _on_the_wire() -> dict[str, object]:
    """One value of every wire, built by the module that owns it (``Wire.where``)."""
    from bidir_kv.engine import notifications
    from bidir_kv.engine.transport import wire as transport
    from bidir_kv.wire import fence
    from bidir_kv.wire.params import CHAIN_KEY, LEASE_KEY, VERIFY_KEY

    names = {
        k: getattr(transport, k)
        for k in transport.__all__
        if isinstance(getattr(transport, k), str | int)
    }
    return {
        "transport": {
            **names,
            "frame header": transport.FRAME_HEADER.format,
            "tcp metadata": {k: t.__name__ for k, t in transport.TCP_METADATA.items()},
            "nixl metadata": {k: t.__name__ for k, t in transport.NIXL_METADATA.items()},
            "accept": transport.accept({"nbytes": 4}),
            "refuse": transport.refuse("no"),
        },
        "notifications": [
            notifications.read_done("req-1", 2),
            notifications.heartbeat(["a", "b"]),
        ],
        "token chain": {CHAIN_KEY: HeldTokens.of(list(range(10)), 4).to_wire()},
        "lease": {LEASE_KEY: lease_to_wire(30)},
        "fence": {
            fence.FENCE_KEY: [fence.reader_advert(), fence.word_to_wire(3, 77, base=4096)],
        },
        "verify": {VERIFY_KEY: verifier_advert()},
        "kv cache groups": {
            GROUPS_KEY: groups_to_wire([KVGroup.sliding(128, 16), KVGroup.full(16)])
        },
    }


# Every wire's version and one value of it, written out: an incompatible change to a
# wire shows here first, and must come with a new line in the wire's history
# (bidir_kv/wire/versions.py), so engines and routers of two versions refuse each other
# instead of misreading. The token chain's hashes also pin policy.block_hashes and
# policy.tail_hash, which a router's stored entries outlive a deploy with.
PINNED: dict[str, tuple[int, object]] = {
    "transport": (
        2,
        {
            "BLOCKS": "blocks",
            "ERROR": "error",
            "FENCE_BASE": "fence_base",
            "FENCE_SLOTS": "fence_slots",
            "MAX_FRAME": 16 * 1024 * 1024,
            "MESSAGE": "msg",
            "META": "meta",
            "NBYTES": "nbytes",
            "NIXL": "nixl",
            "NOTIFICATION": "notif",
            "NOW": "now",
            "OK": "ok",
            "OP": "op",
            "OP_DONE": "done",
            "OP_GET_META": "get_meta",
            "OP_NOTIF": "notif",
            "OP_PING": "ping",
            "OP_READ": "read",
            "OP_WORD": "word",
            "SENDER": "from",
            "SLOT": "slot",
            "TCP": "tcp",
            "TRANSPORT": "transport",
            "VERSION": "v",
            "WORD": "word",
            "frame header": ">I",
            "tcp metadata": {
                "name": "str",
                "host": "str",
                "port": "int",
                "num_blocks": "int",
                "block_nbytes": "int",
            },
            "nixl metadata": {
                "name": "str",
                "agent_md": "bytes",
                "base": "int",
                "num_blocks": "int",
                "block_nbytes": "int",
            },
            "accept": {"ok": True, "nbytes": 4},
            "refuse": {"ok": False, "error": "no"},
        },
    ),
    "notifications": (1, ["req-1:2", "HB:a,b"]),
    "token chain": (
        1,
        {
            "bidir_kv_chain": {
                "v": 1,
                "block_size": 4,
                "num_tokens": 10,
                "tail": "d37c727e99937201e673984210962327",
                "chain": ["7a407ba0363e7669cf64c0f41be0f711", "d06f6afefc0fd29793a6083265e08596"],
            }
        },
    ),
    "lease": (1, {"bidir_kv_lease": {"v": 1, "idle_seconds": 30.0}}),
    "fence": (
        1,
        {
            "bidir_kv_fence": [
                {"v": 1, "reads": True},
                {"v": 1, "slot": 3, "gen": 77, "base": 4096},
            ]
        },
    ),
    "verify": (1, {"bidir_kv_verify": {"v": 1, "chain": True}}),
    "kv cache groups": (
        1,
        {
            "bidir_kv_groups": {
                "v": 1,
                "groups": [
                    {"kind": "sliding_window", "block_size": 16, "window": 128},
                    {"kind": "full", "block_size": 16},
                ],
            }
        },
    ),
}


@pytest.mark.parametrize("name", [w.name for w in versions.WIRES])
def test_a_wire_changes_only_with_a_new_version(name: str) -> None:
    wire = next(w for w in versions.WIRES if w.name == name)
    assert name in PINNED, f"the {name} wire is not pinned here: add its version and a value"
    version, value = PINNED[name]
    assert wire.version == version, (
        f"the {name} wire is version {wire.version}, pinned at {version}: pin the new "
        "version and its value here"
    )
    assert _on_the_wire()[name] == value, (
        f"the {name} wire changed without a new version: add a line to its history in "
        f"bidir_kv/wire/versions.py (a peer of version {version} would misread it), then "
        "pin the new version and value here"
    )


def test_every_pinned_wire_is_in_the_registry() -> None:
    assert set(PINNED) == {w.name for w in versions.WIRES} == set(_on_the_wire())


# ---- the values' edges: what a reader accepts and what it refuses ------------------------


def test_a_fence_word_at_its_edges() -> None:
    from bidir_kv.wire.fence import FENCE_KEY, word_base, word_of, word_to_wire

    def params(**word: object) -> dict[str, object]:
        return {FENCE_KEY: {"v": 1, "slot": 0, "gen": 1, **word}}

    assert word_of(params()) == (0, 1)  # slot 0 and generation 1 are words
    assert word_of(params(gen=2**64 - 1)) == (0, 2**64 - 1)
    for bad in ({"slot": -1}, {"gen": 0}, {"gen": 2**64}, {"slot": True}, {"gen": "1"}):
        assert word_of(params(**bad)) is None, bad
    assert word_of(None) is None and word_of({}) is None
    assert word_base({FENCE_KEY: word_to_wire(3, 7, base=4096)}) == 4096
    for base in (0, -4096, True, "4096", None):
        assert word_base(params(base=base)) is None, base
    assert word_base({FENCE_KEY: word_to_wire(3, 7)}) is None
    assert word_base({FENCE_KEY: "4096"}) is None
    assert word_base(None) is None and word_base({}) is None


def test_a_token_chain_that_does_not_cover_its_tokens_is_refused_by_name() -> None:
    good = HeldTokens.of(list(range(10)), 4).to_wire()
    one = HeldTokens.of(list(range(3)), 1).to_wire()  # a block of one token is a chain
    assert HeldTokens.from_wire(one).block_size == 1 and len(HeldTokens.from_wire(one).chain) == 3
    for bad in (
        {**good, "block_size": 0},
        {**good, "block_size": -4, "num_tokens": 0, "chain": []},
        {**good, "num_tokens": 12},  # three blocks' tokens, two blocks' chain
    ):
        with pytest.raises(ValueError) as err:
            HeldTokens.from_wire(bad)
        assert str(err.value) == "malformed held tokens: the chain does not cover num_tokens"
    with pytest.raises(ValueError) as other:
        HeldTokens.from_wire({**good, "v": 2})
    assert str(other.value) == "malformed held tokens: not version 1"
    with pytest.raises(ValueError) as short:
        HeldTokens.of(list(range(10)), 4, chain=[b"\0" * 16])
    assert str(short.value) == "chain covers 1 blocks, 10 tokens need 2"


def test_fence_slots_start_at_the_clock_and_refuse_an_empty_table() -> None:
    import time

    from bidir_kv.wire.fence import FenceConfig, FenceSlots

    before = time.time_ns() // 1_000_000
    slots = FenceSlots(2)
    after = time.time_ns() // 1_000_000
    assert slots.num_slots == 2
    word = slots.export("a")
    assert word is not None and word[0] == 0
    # the first value is the clock's milliseconds shifted by 16 bits, plus one: a D
    # restarted later never exports a value it exported before
    assert before << 16 < word[1] <= (after << 16) + 1
    for bad in (0, -1):
        with pytest.raises(ValueError) as err:
            FenceSlots(bad)
        assert str(err.value) == f"a fence table needs slots, got {bad}"
    cfg = FenceConfig.from_extra({"bidir_kv_fence": "yes"})
    assert cfg.fence is False and cfg.problems
    assert FenceConfig.from_extra(None).fence is True


def test_a_word_table_address_of_one_is_an_address() -> None:
    from bidir_kv.wire.fence import FENCE_KEY, word_base, word_to_wire

    assert word_base({FENCE_KEY: word_to_wire(0, 1, base=1)}) == 1
