"""Bounds from a stored baseline: the hardware tier against the last release's run.

Every tier run is stored by pytest-benchmark (``--benchmark-storage DIR
--benchmark-autosave`` or ``--benchmark-save NAME``): one JSON file per run with each
``test_off_vs_on[LEN]``'s rounds in its ``extra_info`` and, through the
``pytest_benchmark_update_machine_info`` hook below, the deployment under
``machine_info["bidir_kv"]`` (model, vLLM and NIXL versions, backend, launcher, hosts).

``--hw-baseline RUN`` names a stored run the way ``--benchmark-compare`` does (its number
``0001``, a name glob, or a file). Per length, the gate fails when against it

* the ON TTFT median rose by more than ``--hw-max-regression`` percent
  (pytest-benchmark's :class:`~pytest_benchmark.utils.PercentageRegressionCheck`), or
* the OFF/ON speedup fell by more than that percentage (:class:`DropCheck`, the same
  check for a field where smaller is worse).

The self-calibrated bound of :mod:`bidir_kv.testing.hw_gates` stays as a consistency
check beside it; the baseline is what says a candidate is no worse than the release.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping
from typing import Any

import pytest
from pytest_benchmark.utils import PercentageRegressionCheck, RegressionCheck, load_storage

from bidir_kv.testing.hw_gates import GateFailure, LengthResult

__all__ = [
    "Baseline",
    "DropCheck",
    "gate_baseline",
    "load_baseline",
    "summarize",
]

_LOG = logging.getLogger("bidir_kv.hw_baseline")


class DropCheck(RegressionCheck):
    """Percent by which ``current[field]`` fell below ``compared[field]`` (a speedup)."""

    def compute(self, current: Mapping[str, float], compared: Mapping[str, float]) -> float:
        val = compared[self.field]
        if not val:
            return float("inf")
        return float(100 - current[self.field] / val * 100)


def summarize(result: LengthResult) -> dict[str, float]:
    """The fields compared per length: ON TTFT median (s) and OFF/ON speedup."""
    return {"on_median": statistics.median(result.on_s), "speedup": result.speedup}


class Baseline:
    """One stored run: where it came from, its deployment, its per-length summaries."""

    def __init__(self, source: str, data: Mapping[str, Any]) -> None:
        self.source = source
        self.deployment: dict[str, Any] = dict(data.get("machine_info", {}).get("bidir_kv", {}))
        self.lengths: dict[int, dict[str, float]] = {}
        for bench in data.get("benchmarks", []):
            info = bench.get("extra_info", {})
            if "history_tokens" not in info or not info.get("on_s") or not info.get("off_s"):
                continue
            res = LengthResult(
                history_tokens=int(info["history_tokens"]),
                prompt_tokens=0,  # not compared (summarize reads the rounds only)
                off_s=list(info["off_s"]),
                on_s=list(info["on_s"]),
            )
            self.lengths[res.history_tokens] = summarize(res)


def load_baseline(storage: str, run: str) -> Baseline:
    """The newest stored run matching ``run`` in pytest-benchmark ``storage``; raises
    :class:`pytest.UsageError` naming the storage when there is none."""
    store = load_storage(storage, logger=_LOG, default_machine_id=None, netrc="")
    found = list(store.load(run)) or list(store.load(f"*_{run}"))  # a number, or a name
    if not found:
        raise pytest.UsageError(
            f"--hw-baseline {run}: no stored run matches in {store} "
            "(runs are stored with --benchmark-autosave or "
            "--benchmark-save)"
        )
    path, data = found[-1]
    return Baseline(str(path), data)


def gate_baseline(
    length: int, current: LengthResult, baseline: Baseline, max_regression: float
) -> str:
    """Fail when ``current`` regressed against ``baseline`` at ``length`` by more than
    ``max_regression`` percent; returns what was compared."""
    base = baseline.lengths.get(length)
    if base is None:
        raise GateFailure(
            f"length {length}: baseline {baseline.source} has no rounds at this "
            f"length (it has {sorted(baseline.lengths) or 'none'})"
        )
    now = summarize(current)
    checks = (
        PercentageRegressionCheck("on_median", max_regression),
        DropCheck("speedup", max_regression),
    )
    failed = [(c, c.compute(now, base)) for c in checks if c.fails(now, base)]
    shown = (
        f"ON median {now['on_median'] * 1e3:.1f} ms vs {base['on_median'] * 1e3:.1f} ms, "
        f"speedup {now['speedup']:.3f}x vs {base['speedup']:.3f}x "
        f"(baseline {baseline.source})"
    )
    if failed:
        what = "; ".join(
            f"{'ON TTFT median rose' if c.field == 'on_median' else 'speedup fell'} {pct:.1f} %"
            for c, pct in failed
        )
        raise GateFailure(
            f"length {length}: regression beyond {max_regression:g} %: {what}: {shown}"
        )
    return shown


def _deployment_summary(config: pytest.Config) -> dict[str, Any]:
    from bidir_kv.testing.hardware import deployment_info

    info = deployment_info(config)
    keys = (
        "kind",
        "model",
        "vllm",
        "nixl",
        "backend",
        "launcher",
        "hosts",
        "block_size",
        "kv_bytes_per_token",
    )
    return {k: info.get(k) for k in keys}


def pytest_benchmark_update_machine_info(
    config: pytest.Config, machine_info: dict[str, Any]
) -> None:
    """Store the deployment with every saved run (compared against on ``--hw-baseline``)."""
    machine_info["bidir_kv"] = _deployment_summary(config)
