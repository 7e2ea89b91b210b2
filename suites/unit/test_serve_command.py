"""`bidir-kv serve`'s command builder: the publication's two nodes flag for flag, and the
knobs that change them."""

from __future__ import annotations

import json
import shlex

import pytest

from bidir_kv.serve.cli import main
from bidir_kv.serve.command import ServeSpec, argv_value, build, recipe_pair

MODEL = "Qwen/Qwen3-32B"
P_IP, D_IP = "10.0.0.1", "10.0.0.2"


def _recipe_kv(role: str, rank: int, bidir: bool = True) -> dict[str, object]:
    """The published --kv-transfer-config (docs/hardware.md §1, docs/protocol.md §13.2)."""
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "engine_id": f"{role}-engine-001",
        "kv_buffer_device": "cuda",
        "kv_rank": rank,
        "kv_parallel_size": 2,
        "kv_connector_extra_config": {
            "backends": ["LIBFABRIC"],
            "bidirectional_kv_xfer": bidir,
            "kv_recompute_threshold": 64,
            "decoder_kv_blocks_ttl": 480.0,
        },
    }


def _flags(argv: tuple[str, ...]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    rest = list(argv[3:])
    while rest:
        flag = rest.pop(0)
        out[flag] = rest.pop(0) if rest and not rest[0].startswith("--") else None
    return out


@pytest.mark.parametrize(
    "role,ip,port,rank", [("prefill", P_IP, 8100, 0), ("decode", D_IP, 8200, 1)]
)
def test_the_publications_nodes_flag_for_flag(role: str, ip: str, port: int, rank: int) -> None:
    p, d = recipe_pair(MODEL, P_IP, D_IP)
    cmd = build(p if role == "prefill" else d)
    assert cmd.argv[:3] == ("vllm", "serve", MODEL)
    flags = _flags(cmd.argv)
    kv = json.loads(str(flags.pop("--kv-transfer-config")))
    assert kv == _recipe_kv(role, rank)
    expected: dict[str, str | None] = {
        "--host": "0.0.0.0",
        "--port": str(port),
        "--dtype": "bfloat16",
        "--tensor-parallel-size": "8",
        "--max-model-len": "32768",
        "--max-num-seqs": "8",
    }
    if role == "prefill":
        expected["--no-enable-prefix-caching"] = None  # on P only
    assert flags == expected
    assert dict(cmd.env) == {
        "FI_PROVIDER": "efa",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": ip,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
    }


def test_dry_run_prints_exports_and_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "--role",
            "prefill",
            "--model",
            MODEL,
            "--ip",
            P_IP,
            "--peer-ip",
            D_IP,
            "--tp",
            "8",
            "--max-model-len",
            "32768",
            "--max-num-seqs",
            "8",
            "--dtype",
            "bfloat16",
            "--nixl-backend",
            "LIBFABRIC",
            "--cold-prefill",
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "export FI_PROVIDER=efa" in out
    assert f"export VLLM_NIXL_SIDE_CHANNEL_HOST={P_IP}" in out
    assert "--no-enable-prefix-caching" in out
    assert f"--prefiller-host {P_IP}" in out and f"--decoder-host {D_IP}" in out
    # the CLI and the recipe helper agree: the dry run is the recipe
    script = out.split("vllm serve", 1)[1]
    assert '"kv_rank": 0' in script and '"backends": ["LIBFABRIC"]' in script


def test_off_leg_turns_the_switch_off_on_both_nodes() -> None:
    for spec in recipe_pair(MODEL, P_IP, D_IP, bidir=False):
        kv = json.loads(str(argv_value(build(spec).argv, "--kv-transfer-config")))
        assert kv["kv_connector_extra_config"]["bidirectional_kv_xfer"] is False


def test_cold_prefill_never_touches_d() -> None:
    d = build(ServeSpec(role="decode", model="m", cold_prefill=True))
    assert "--no-enable-prefix-caching" not in d.argv
    assert any("P only" in n for n in d.notes)
    p = build(ServeSpec(role="prefill", model="m"))
    assert "--no-enable-prefix-caching" not in p.argv  # opt-in


def test_devices_pick_their_visibility_variable_and_buffer() -> None:
    neuron = build(
        ServeSpec(
            role="prefill",
            model="m",
            device="neuron",
            visible="0-31",
            nixl_backend="LIBFABRIC",
            nixl_debug=True,
        )
    )
    assert neuron.env["NEURON_RT_VISIBLE_CORES"] == "0-31"
    assert neuron.env["NIXL_LOG_LEVEL"] == "DEBUG"
    kv = json.loads(str(argv_value(neuron.argv, "--kv-transfer-config")))
    assert kv["kv_buffer_device"] == "cpu"
    assert any("unverified" in n for n in neuron.notes)
    cuda = build(ServeSpec(role="decode", model="m", visible="4,5,6,7"))
    assert cuda.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and "FI_PROVIDER" not in cuda.env
    cpu = build(ServeSpec(role="decode", model="m", device="cpu", visible="1"))
    assert cpu.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"device": "tpu"}, "device"),
        ({"nixl_backend": "TCP"}, "backend"),
        ({"tp": 0}, "tensor parallel"),
        ({"decoder_kv_blocks_ttl": 0}, "decoder_kv_blocks_ttl"),
        ({"connector": "lmcache"}, "connector must be one of"),
        ({"connector": "bidir-kv", "kv_top": {"kv_connector_module_path": "x.y"}}, "gives 'x.y'"),
    ],
)
def test_bad_knobs_are_refused_by_name(bad: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build(ServeSpec(role="prefill", model="m", **bad))  # type: ignore[arg-type]


def test_cli_refuses_a_bad_switch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--role", "prefill", "--model", "m", "--bidir", "maybe", "--dry-run"])
    assert "on or off" in capsys.readouterr().err


def test_extra_flags_pass_through_after_double_dash(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "--role",
                "decode",
                "--model",
                "m",
                "--dry-run",
                "--",
                "--gpu-memory-utilization",
                "0.9",
            ]
        )
        == 0
    )
    assert "--gpu-memory-utilization 0.9" in capsys.readouterr().out


# ---- the peer allowlist (docs/connector.md §7, docs/hardware.md §1) ------------------

ALLOW = "bidir_kv_peer_allowlist"


def _dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[dict], str]:
    """(exit status, every --kv-transfer-config of the dry run in order, the output)."""
    rc = main(["--model", "m", "--dry-run", *args])
    captured = capsys.readouterr()
    out = captured.out
    words = shlex.split(out.replace("\\\n", " "), comments=True)
    configs = [
        json.loads(words[i + 1] if w == "--kv-transfer-config" else w.partition("=")[2])
        for i, w in enumerate(words)
        if w.partition("=")[0] == "--kv-transfer-config"
    ]
    return rc, configs, out + captured.err


@pytest.mark.parametrize(
    "role,ip,peer,expected",
    [
        ("prefill", P_IP, D_IP, [D_IP]),
        ("decode", D_IP, P_IP, [P_IP]),
        ("prefill", P_IP, None, ["decode-engine-001"]),  # no address known: the peer's id
        ("decode", D_IP, None, ["prefill-engine-001"]),
        ("prefill", P_IP, "d-node", ["decode-engine-001"]),  # a name matches no entry
    ],
)
def test_each_node_lists_its_peer_by_default(
    capsys: pytest.CaptureFixture[str],
    role: str,
    ip: str,
    peer: str | None,
    expected: list[str],
) -> None:
    rc, configs, out = _dry_run(
        capsys, "--role", role, "--ip", ip, *(("--peer-ip", peer) if peer else ())
    )
    assert rc == 0 and len(configs) == 1
    assert configs[0]["kv_connector_extra_config"][ALLOW] == expected
    # stock NixlConnector is what serve starts: the dry run says the key is not enforced
    assert "stock NixlConnector ignores the key" in out


def test_an_explicit_allowlist_replaces_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    rc, configs, _ = _dry_run(
        capsys,
        "--role",
        "prefill",
        "--peer-ip",
        D_IP,
        "--peer-allowlist",
        "10.0.0.0/24, decode-a,decode-b",
    )
    assert rc == 0
    assert configs[0]["kv_connector_extra_config"][ALLOW] == ["10.0.0.0/24", "decode-a", "decode-b"]


def test_no_peer_allowlist_leaves_the_key_unset(capsys: pytest.CaptureFixture[str]) -> None:
    rc, configs, out = _dry_run(
        capsys, "--role", "prefill", "--peer-ip", D_IP, "--no-peer-allowlist"
    )
    assert rc == 0 and ALLOW not in configs[0]["kv_connector_extra_config"]
    assert "ignores the key" not in out


@pytest.mark.parametrize(
    "args,says",
    [
        (("--peer-allowlist", ","), "non-empty list"),
        (("--peer-allowlist", "a", "--no-peer-allowlist"), "not allowed with"),
    ],
)
def test_bad_allowlist_flags_are_refused(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], says: str
) -> None:
    with pytest.raises(SystemExit):
        main(["--role", "prefill", "--model", "m", "--dry-run", *args])
    assert says in capsys.readouterr().err


def _own(allow: list[str] | None) -> str:
    extra: dict[str, object] = {"bidirectional_kv_xfer": True}
    if allow is not None:
        extra[ALLOW] = allow
    return json.dumps(
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": extra,
        }
    )


def test_the_users_own_config_wins(capsys: pytest.CaptureFixture[str]) -> None:
    """A --kv-transfer-config after -- replaces serve's (vLLM reads the last flag): its
    allowlist is the one in force, and serve's own config no longer names one."""
    rc, configs, out = _dry_run(
        capsys,
        "--role",
        "prefill",
        "--peer-ip",
        D_IP,
        "--",
        "--kv-transfer-config",
        _own(["10.9.0.0/16"]),
    )
    assert rc == 0 and len(configs) == 2
    assert ALLOW not in configs[0]["kv_connector_extra_config"]
    assert configs[-1]["kv_connector_extra_config"][ALLOW] == ["10.9.0.0/16"]
    assert "sets no" not in out
    # the same value given twice is no clash
    rc, configs, _ = _dry_run(
        capsys,
        "--role",
        "prefill",
        "--peer-allowlist",
        "10.9.0.0/16",
        "--",
        f"--kv-transfer-config={_own(['10.9.0.0/16'])}",
    )
    assert rc == 0 and configs[-1]["kv_connector_extra_config"][ALLOW] == ["10.9.0.0/16"]


def test_the_users_own_config_without_a_list_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    rc, configs, out = _dry_run(
        capsys, "--role", "prefill", "--peer-ip", D_IP, "--", "--kv-transfer-config", _own(None)
    )
    assert rc == 0 and ALLOW not in configs[-1]["kv_connector_extra_config"]
    assert f"sets no {ALLOW}: this node reads KV from any peer" in out


@pytest.mark.parametrize("own", [["10.9.0.0/16"], None])
def test_an_explicit_list_and_the_users_config_clash_loudly(
    capsys: pytest.CaptureFixture[str],
    own: list[str] | None,
) -> None:
    rc, configs, out = _dry_run(
        capsys,
        "--role",
        "prefill",
        "--peer-allowlist",
        "decode-a",
        "--",
        "--kv-transfer-config",
        _own(own),
    )
    assert rc == 2 and configs == []
    assert "--peer-allowlist decode-a clashes with the --kv-transfer-config after --" in out


def test_the_builder_refuses_two_different_lists() -> None:
    spec = ServeSpec(
        role="prefill", model="m", peer_allowlist=("decode-a",), kv_extra={ALLOW: ["decode-b"]}
    )
    with pytest.raises(ValueError, match=f"{ALLOW} is given twice"):
        build(spec)
    same = ServeSpec(
        role="prefill", model="m", peer_allowlist=("decode-a",), kv_extra={ALLOW: ("decode-a",)}
    )
    kv = json.loads(str(argv_value(build(same).argv, "--kv-transfer-config")))
    assert kv["kv_connector_extra_config"][ALLOW] == ["decode-a"]
    with pytest.raises(ValueError, match=ALLOW):
        build(ServeSpec(role="prefill", model="m", peer_allowlist=()))


def test_our_connector_needs_no_note() -> None:
    ours = build(
        ServeSpec(
            role="prefill",
            model="m",
            peer_allowlist=(D_IP,),
            kv_top={"kv_connector_module_path": "bidir_kv.connector"},
        )
    )
    assert not any("ignores the key" in n for n in ours.notes)
    stock = build(ServeSpec(role="prefill", model="m", peer_allowlist=(D_IP,)))
    assert any("ignores the key" in n for n in stock.notes)


# ---- --connector: ours through kv_connector_module_path (docs/connector.md) -----------


def test_connector_flag_loads_ours_on_both_roles(capsys: pytest.CaptureFixture[str]) -> None:
    for role in ("prefill", "decode"):
        rc, configs, out = _dry_run(capsys, "--role", role, "--connector", "bidir-kv")
        assert rc == 0 and len(configs) == 1
        assert configs[0]["kv_connector_module_path"] == "bidir_kv.connector"
        assert configs[0]["kv_connector"] == "NixlConnector"  # vLLM's checks stay in force
        assert "must import in vLLM's own Python" in out and "ignores the key" not in out
    rc, configs, out = _dry_run(capsys, "--role", "prefill")  # default: stock
    assert rc == 0 and "kv_connector_module_path" not in configs[0]


def test_connector_flag_and_the_users_config_must_agree(
    capsys: pytest.CaptureFixture[str],
) -> None:
    own = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"})
    rc, configs, out = _dry_run(
        capsys, "--role", "prefill", "--connector", "bidir-kv", "--", "--kv-transfer-config", own
    )
    assert rc == 2 and not configs
    assert "--connector bidir-kv clashes" in out and "has none" in out
    ours = json.dumps(
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer",
            "kv_connector_module_path": "bidir_kv.connector",
        }
    )
    rc, configs, _ = _dry_run(
        capsys, "--role", "prefill", "--connector", "bidir-kv", "--", "--kv-transfer-config", ours
    )
    assert rc == 0 and configs[-1]["kv_connector_module_path"] == "bidir_kv.connector"
