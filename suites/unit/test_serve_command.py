"""`bidir-kv serve`'s command builder: the publication's two nodes flag for flag, and the
knobs that change them."""

from __future__ import annotations

import json

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


@pytest.mark.parametrize("role,ip,port,rank", [("prefill", P_IP, 8100, 0),
                                               ("decode", D_IP, 8200, 1)])
def test_the_publications_nodes_flag_for_flag(role: str, ip: str, port: int, rank: int) -> None:
    p, d = recipe_pair(MODEL, P_IP, D_IP)
    cmd = build(p if role == "prefill" else d)
    assert cmd.argv[:3] == ("vllm", "serve", MODEL)
    flags = _flags(cmd.argv)
    kv = json.loads(str(flags.pop("--kv-transfer-config")))
    assert kv == _recipe_kv(role, rank)
    expected: dict[str, str | None] = {
        "--host": "0.0.0.0", "--port": str(port), "--dtype": "bfloat16",
        "--tensor-parallel-size": "8", "--max-model-len": "32768", "--max-num-seqs": "8",
    }
    if role == "prefill":
        expected["--no-enable-prefix-caching"] = None  # on P only
    assert flags == expected
    assert dict(cmd.env) == {"FI_PROVIDER": "efa", "VLLM_NIXL_SIDE_CHANNEL_HOST": ip,
                             "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}


def test_dry_run_prints_exports_and_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--role", "prefill", "--model", MODEL, "--ip", P_IP, "--peer-ip", D_IP,
               "--tp", "8", "--max-model-len", "32768", "--max-num-seqs", "8",
               "--dtype", "bfloat16", "--nixl-backend", "LIBFABRIC", "--cold-prefill",
               "--dry-run"])
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
    neuron = build(ServeSpec(role="prefill", model="m", device="neuron", visible="0-31",
                             nixl_backend="LIBFABRIC", nixl_debug=True))
    assert neuron.env["NEURON_RT_VISIBLE_CORES"] == "0-31"
    assert neuron.env["NIXL_LOG_LEVEL"] == "DEBUG"
    kv = json.loads(str(argv_value(neuron.argv, "--kv-transfer-config")))
    assert kv["kv_buffer_device"] == "cpu"
    assert any("unverified" in n for n in neuron.notes)
    cuda = build(ServeSpec(role="decode", model="m", visible="4,5,6,7"))
    assert cuda.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and "FI_PROVIDER" not in cuda.env
    cpu = build(ServeSpec(role="decode", model="m", device="cpu", visible="1"))
    assert cpu.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"


@pytest.mark.parametrize("bad,match", [({"device": "tpu"}, "device"),
                                       ({"nixl_backend": "TCP"}, "backend"),
                                       ({"tp": 0}, "tensor parallel"),
                                       ({"decoder_kv_blocks_ttl": 0}, "decoder_kv_blocks_ttl")])
def test_bad_knobs_are_refused_by_name(bad: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build(ServeSpec(role="prefill", model="m", **bad))  # type: ignore[arg-type]


def test_cli_refuses_a_bad_switch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--role", "prefill", "--model", "m", "--bidir", "maybe", "--dry-run"])
    assert "on or off" in capsys.readouterr().err


def test_extra_flags_pass_through_after_double_dash(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--role", "decode", "--model", "m", "--dry-run", "--",
                 "--gpu-memory-utilization", "0.9"]) == 0
    assert "--gpu-memory-utilization 0.9" in capsys.readouterr().out
