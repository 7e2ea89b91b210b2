"""The hardware tier's options object: typed values, defaults stated once, contradictions
refused before any node starts (bidir_kv/testing/hw_options.py, docs/hardware.md §3)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.testing.hw_options import (
    CPU_LENGTHS,
    GPU_LENGTHS,
    QUICK_LENGTHS,
    HwOptions,
    add_options,
)

URLS = {"prefill_url": "http://p:8100", "decode_url": "http://d:8200"}
LAUNCH = {"launch": True, "launch_model": "Qwen/Qwen3-32B"}


class _Group:
    """Records what add_options declares."""

    def __init__(self) -> None:
        self.options: dict[str, dict[str, Any]] = {}

    def addoption(self, flag: str, **kw: Any) -> None:
        self.options[flag] = kw


def _declared() -> dict[str, dict[str, Any]]:
    group = _Group()
    add_options(group)  # type: ignore[arg-type]
    return group.options


def test_every_option_is_a_field_and_states_its_default() -> None:
    declared = _declared()
    fields = {f.name for f in dataclasses.fields(HwOptions)} - {"prefill_url", "decode_url"}
    assert set(declared) == {"--hw-" + name.replace("_", "-") for name in fields}
    for flag, kw in declared.items():
        assert "(default: " in kw["help"], flag
        assert kw["default"] is None, f"{flag}: 'not given' must be visible"
    assert "(default: 10.0)" in declared["--hw-max-regression"]["help"]
    assert "(default: 64)" in declared["--hw-threshold"]["help"]
    assert "out/hardware" in declared["--hw-report"]["help"]


def test_nothing_given_is_the_dry_run_with_its_defaults() -> None:
    opts = HwOptions.from_given({})
    assert opts == HwOptions() and not opts.remote and opts.lengths == CPU_LENGTHS
    assert opts.max_regression == 10.0 and opts.threshold == 64 and opts.fabric == "auto"


def test_values_are_parsed_once_into_types() -> None:
    opts = HwOptions.from_given(
        {
            **LAUNCH,
            "launcher": "ssh",
            "hosts": "ubuntu@10.0.0.1, ubuntu@10.0.0.2",
            "ssh_option": ["-F", "cfg"],
            "prompt_tokens": "2000,4e3",
            "min_speedup": "2000=1.3,4000=2",
            "fabric": "efa:rdmap0",
            "report": "out/x",
            "quick": False,  # store_true not given
        }
    )
    assert opts.hosts == ("ubuntu@10.0.0.1", "ubuntu@10.0.0.2") and opts.ssh_option == ("-F", "cfg")
    assert opts.prompt_tokens == (2000, 4000) and opts.lengths == (2000, 4000)
    assert opts.min_speedup == {2000: 1.3, 4000: 2.0} and opts.report == Path("out/x")
    assert opts.remote and not opts.quick


def test_lengths_follow_the_deployment() -> None:
    assert HwOptions.from_given(URLS).lengths == GPU_LENGTHS
    assert HwOptions.from_given({**URLS, "quick": True}).lengths == QUICK_LENGTHS
    assert HwOptions.from_given({**LAUNCH, "quick": True}).lengths == QUICK_LENGTHS


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"prompt_tokens": "2000,x"}, "--hw-prompt-tokens"),
        ({"prompt_tokens": "0,2000"}, "--hw-prompt-tokens must be positive lengths"),
        ({"min_speedup": "2000:1.3"}, "--hw-min-speedup: expected LEN=X"),
        ({"min_speedup": "2000=0"}, "--hw-min-speedup must be positive bounds"),
        ({"hosts": "one-host"}, "--hw-hosts: expected P_HOST,D_HOST"),
        ({"fabric": "rdma"}, "--hw-fabric: expected efa"),
        ({"turns": 1}, "--hw-turns must be at least 2"),
        ({"conversations": 0}, "--hw-conversations must be at least 1"),
        ({"clients": 0}, "--hw-clients must be at least 1"),
        ({"rounds": 0}, "--hw-rounds must be at least 1"),
        ({"min_line_share": 1.5}, "--hw-min-line-share must be a share in (0, 1]"),
        ({"calibration_tolerance": 1.0}, "--hw-calibration-tolerance must be a share in [0, 1)"),
        ({"fabric_overhead": 0.9}, "--hw-fabric-overhead must be a factor of 1 or more"),
        ({"max_regression": -1.0}, "--hw-max-regression must be a percentage"),
        ({"line_rate_gbps": float("nan")}, "--hw-line-rate-gbps must be positive"),
        ({"kv_bytes_per_token": 0.0}, "--hw-kv-bytes-per-token must be positive"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_the_option(
    given: dict[str, Any], message: str
) -> None:
    with pytest.raises(pytest.UsageError, match=None) as exc:
        HwOptions.from_given(given)
    assert message in str(exc.value)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"prefill_url": "http://p:8100"}, "--prefill-url and --decode-url go together"),
        ({**URLS, **LAUNCH}, "give one or the other"),
        ({"launch": True}, "--hw-launch needs --hw-launch-model"),
        ({"tp": 8}, "--hw-tp only apply with --hw-launch"),
        ({"launch_arg": ["--x"], "image": "i"}, "--hw-image, --hw-launch-arg only apply"),
        ({**URLS, "launcher": "ssh"}, "a deployment by URL is placed already"),
        ({**LAUNCH, "launcher": "auto"}, "--hw-launcher auto is the dry run's choice"),
        ({"launcher": "slurm"}, "the vllm-cpu dry run places its nodes with local or ssh"),
        ({"launcher": "kubernetes"}, "the vllm-cpu dry run places its nodes"),
        ({**LAUNCH, "launcher": "ssh"}, "--hw-launcher ssh needs --hw-hosts"),
        ({"hosts": "a,b"}, "--hw-hosts applies to --hw-launch with --hw-launcher ssh"),
        ({**LAUNCH, "hosts": "a,b"}, "--hw-hosts applies to"),
        ({"ssh_option": ["-v"]}, "--hw-ssh-option applies to --hw-launch"),
        ({**LAUNCH, "launcher": "kubernetes", "fabric": "efa"}, "reads no fabric counters"),
        ({"fabric": "off", "fabric_overhead": 1.1}, "--hw-fabric is off"),
    ],
)
def test_a_contradiction_is_a_usage_error(given: dict[str, Any], message: str) -> None:
    with pytest.raises(pytest.UsageError) as exc:
        HwOptions.from_given(given)
    assert message in str(exc.value)


def test_a_bound_of_a_gate_that_is_off_is_no_contradiction() -> None:
    """The release workflow passes --hw-max-regression on every run; the first has no
    baseline yet. Likewise --hw-min-line-share without a line rate."""
    opts = HwOptions.from_given({**LAUNCH, "max_regression": 15.0, "min_line_share": 0.4})
    assert opts.baseline is None and opts.max_regression == 15.0
    assert HwOptions.from_given({"launcher": "local"}).launcher == "local"  # the dry run
    ok = {**LAUNCH, "launcher": "slurm", "ssh_option": ["-F", "c"], "fabric": "efa"}
    assert HwOptions.from_given(ok).ssh_option == ("-F", "c")


@pytest.mark.parametrize("name", ["turns", "block_size", "fabric_overhead"])
def test_zero_is_given_not_absent(name: str) -> None:
    with pytest.raises(pytest.UsageError):
        HwOptions.from_given({name: 0})


def test_the_decode_gate_bound_depends_on_the_deployment_unless_given() -> None:
    """20 % on a release deployment, 200 % on the vllm-cpu dry run (docs/hardware.md §4);
    a given bound holds on both; a negative one is a usage error naming the option."""
    assert HwOptions.from_given(URLS).tpot_bound == 20.0
    assert HwOptions.from_given({}).tpot_bound == 200.0
    given = {"max_tpot_regression": 35.0}
    assert HwOptions.from_given({**URLS, **given}).tpot_bound == 35.0
    assert HwOptions.from_given(given).tpot_bound == 35.0
    with pytest.raises(pytest.UsageError, match="--hw-max-tpot-regression must be a percentage"):
        HwOptions.from_given({"max_tpot_regression": -1.0})
