"""`bidir-kv engine` command line: bad flags exit 2 naming the problem; startup log lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bidir_kv.launch.process import ManagedProcess, free_port, wait_http_ok

ENGINE = [sys.executable, "-m", "bidir_kv", "engine"]


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ENGINE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["tiny", "--kv-transfer-config", "{bad"], {}, "--kv-transfer-config is not valid JSON"),
        (
            ["tiny", "--kv-transfer-config", '{"kv_load_failure_policy": "retry"}'],
            {},
            "kv_load_failure_policy",
        ),
        (
            [
                "tiny",
                "--kv-transfer-config",
                '{"kv_connector_extra_config": {"kv_recompute_threshold": "many"}}',
            ],
            {},
            "kv_recompute_threshold",
        ),
        (["tiny", "--block-size", "0"], {}, "--block-size must be positive"),
        (["tiny", "--transport", "carrier-pigeon"], {}, "--transport"),
        (["tiny", "--profile", "no-such-profile"], {}, "unknown profile 'no-such-profile'"),
        (["tiny", "--fault-fail-transfers", "2"], {}, "fail_transfers"),
        (["tiny", "--tensor-parallel-size", "0"], {}, "--tensor-parallel-size"),
        (["tiny", "--kv-bytes-per-token", "63"], {}, "multiple of num_layers"),
        (["tiny"], {"VLLM_NIXL_SIDE_CHANNEL_PORT": "abc"}, "VLLM_NIXL_SIDE_CHANNEL_PORT"),
        ([], {}, "MODEL is required"),
    ],
)
def test_bad_configuration_exits_2_naming_the_problem(
    args: list[str], env: dict[str, str], needle: str
) -> None:
    res = run(args, env)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr


def test_help_lists_vllm_and_emulator_flags() -> None:
    res = run(["--help"])
    assert res.returncode == 0
    for flag in (
        "--served-model-name",
        "--max-model-len",
        "--block-size",
        "--no-enable-prefix-caching",
        "--kv-transfer-config",
        "--max-num-batched-tokens",
        "--profile",
        "--kv-capacity-tokens",
        "--transport",
        "--emulate-vllm",
        "--kv-pairing",
        "--fault-exit-on-request",
    ):
        assert flag in res.stdout, flag


def test_startup_logs_vllm_line_and_serves(tmp_path: Path) -> None:
    port, side = free_port(), free_port()
    kv = (
        '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","engine_id":"d-1",'
        '"kv_connector_extra_config":{"bidirectional_kv_xfer":true,'
        '"kv_recompute_threshold":64,"decoder_kv_blocks_ttl":120}}'
    )
    env = {
        **os.environ,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
    }
    proc = ManagedProcess(
        "engine",
        [
            *ENGINE,
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--transport",
            "tcp",
            "--kv-transfer-config",
            kv,
        ],
        tmp_path / "engine.log",
        env=env,
    ).start()
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 60, alive=proc)
        log = (tmp_path / "engine.log").read_text()
        assert (
            "Bidirectional KV transfer is enabled and the kv recompute threshold is set to 64 "
            "tokens.KV blocks on D are released after a TTL of 120 seconds." in log
        )
        assert f"side channel 127.0.0.1:{side}" in log
    finally:
        proc.stop()
    assert proc.returncode == 0  # SIGTERM is a clean shutdown
