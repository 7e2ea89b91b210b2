"""``--kv-transfer-config`` as vLLM reads it, for the NixlConnector in bidirectional mode.

One typed reading, used by the emulated engine (which accepts the same JSON as
``vllm serve``) and by launchers that write the JSON for real vLLM.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from bidir_kv.errors import ConfigError
from bidir_kv.policy import (
    DEFAULT_DECODER_KV_BLOCKS_TTL,
    DEFAULT_KV_LEASE_DURATION,
    DEFAULT_RECOMPUTE_THRESHOLD,
    PeerAllowlist,
    threshold_enabled,
    valid_lease_duration,
    valid_retention_ttl,
)
from bidir_kv.wire.fence import ALLOWLIST_CONFIG_KEY
from bidir_kv.wire.params import LEASE_CONFIG_KEY, configured_lease

__all__ = ["CONNECTOR_MODULE_PATH", "ConfigError", "KVTransferConfig", "LoadFailurePolicy"]

# ``kv_connector_module_path`` that loads our connector into vLLM: the package exports
# ``NixlConnector`` as its BidirKVConnector, so ``kv_connector`` keeps vLLM's name
CONNECTOR_MODULE_PATH = "bidir_kv.connector"

LoadFailurePolicy = Literal["fail", "recompute"]
_CONNECTORS = ("NixlConnector",)
_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# extra-config keys with a typed attribute; ``KVTransferConfig.extra`` keeps only the others
_TYPED_EXTRA = (
    "bidirectional_kv_xfer",
    "kv_recompute_threshold",
    "decoder_kv_blocks_ttl",
    "kv_lease_duration",
    "backends",
    "enforce_handshake_compat",
)


# top-level keys with a typed attribute; ``KVTransferConfig.top_level`` keeps the others
_TYPED_TOP = (
    "kv_connector",
    "kv_role",
    "engine_id",
    "kv_buffer_device",
    "kv_load_failure_policy",
    "kv_connector_extra_config",
)


def _get(extra: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    if key not in extra or extra[key] is None:
        return default
    value = extra[key]
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            raise TypeError
        if isinstance(value, bool):
            raise TypeError
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"kv_connector_extra_config.{key}: expected {kind.__name__}, got {value!r}"
        ) from None


@dataclass(frozen=True)
class KVTransferConfig:
    """The keys of ``--kv-transfer-config`` that bidirectional transfer depends on."""

    kv_connector: str = "NixlConnector"
    kv_role: str = "kv_both"
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    kv_buffer_device: str = "cpu"
    kv_load_failure_policy: LoadFailurePolicy = "fail"
    bidirectional_kv_xfer: bool = False
    kv_recompute_threshold: int = DEFAULT_RECOMPUTE_THRESHOLD
    decoder_kv_blocks_ttl: float = DEFAULT_DECODER_KV_BLOCKS_TTL
    kv_lease_duration: int = DEFAULT_KV_LEASE_DURATION
    backends: tuple[str, ...] = ("UCX",)
    enforce_handshake_compat: bool = True
    # unknown kv_connector_extra_config keys, kept verbatim so to_json() round-trips
    extra: Mapping[str, Any] = field(default_factory=dict)
    # unknown top-level keys (kv_rank, kv_parallel_size, kv_port, ...), kept verbatim too
    top_level: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str | None) -> KVTransferConfig:
        if text is None or not text.strip():
            return cls()
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--kv-transfer-config is not valid JSON: {exc}") from None
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls, obj: Any) -> KVTransferConfig:
        if not isinstance(obj, Mapping):
            raise ConfigError("--kv-transfer-config must be a JSON object")
        connector = obj.get("kv_connector", "NixlConnector")
        if connector not in _CONNECTORS:
            raise ConfigError(
                f"kv_connector: {connector!r} is not supported; bidirectional transfer "
                f"needs one of {', '.join(_CONNECTORS)}"
            )
        role = obj.get("kv_role", "kv_both")
        if role not in _ROLES:
            raise ConfigError(f"kv_role: expected one of {', '.join(_ROLES)}, got {role!r}")
        policy = obj.get("kv_load_failure_policy", "fail")
        if policy not in ("fail", "recompute"):
            raise ConfigError(
                f"kv_load_failure_policy: expected 'fail' or 'recompute', got {policy!r}"
            )
        extra = obj.get("kv_connector_extra_config") or {}
        if not isinstance(extra, Mapping):
            raise ConfigError("kv_connector_extra_config must be a JSON object")
        backends = extra.get("backends", ["UCX"])
        if not isinstance(backends, list) or not all(isinstance(b, str) for b in backends):
            raise ConfigError(
                f"kv_connector_extra_config.backends: expected a list of strings, got {backends!r}"
            )
        ttl = _get(extra, "decoder_kv_blocks_ttl", float, DEFAULT_DECODER_KV_BLOCKS_TTL)
        if not valid_retention_ttl(ttl):
            raise ConfigError(
                f"kv_connector_extra_config.decoder_kv_blocks_ttl: must be > 0, got {ttl}"
            )
        lease = _get(extra, "kv_lease_duration", int, DEFAULT_KV_LEASE_DURATION)
        if not valid_lease_duration(lease):
            raise ConfigError(
                f"kv_connector_extra_config.kv_lease_duration: must be >= 6 s "
                f"(heartbeats every duration // 6), got {lease}"
            )
        try:
            configured_lease(extra.get(LEASE_CONFIG_KEY))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        try:
            PeerAllowlist.parse(extra.get(ALLOWLIST_CONFIG_KEY))
        except ValueError as exc:
            raise ConfigError(f"kv_connector_extra_config.{ALLOWLIST_CONFIG_KEY}: {exc}") from None
        engine_id = obj.get("engine_id") or str(uuid.uuid4())
        if not isinstance(engine_id, str):
            raise ConfigError(f"engine_id: expected a string, got {engine_id!r}")
        return cls(
            kv_connector=connector,
            kv_role=role,
            engine_id=engine_id,
            kv_buffer_device=str(obj.get("kv_buffer_device", "cpu")),
            kv_load_failure_policy=policy,
            bidirectional_kv_xfer=_get(extra, "bidirectional_kv_xfer", bool, False),
            kv_recompute_threshold=_get(
                extra, "kv_recompute_threshold", int, DEFAULT_RECOMPUTE_THRESHOLD
            ),
            decoder_kv_blocks_ttl=ttl,
            kv_lease_duration=lease,
            backends=tuple(backends),
            enforce_handshake_compat=_get(extra, "enforce_handshake_compat", bool, True),
            extra={k: v for k, v in extra.items() if k not in _TYPED_EXTRA},
            top_level={k: v for k, v in obj.items() if k not in _TYPED_TOP},
        )

    @property
    def peer_allowlist(self) -> PeerAllowlist | None:
        """The peers this node reads KV from (``bidir_kv_peer_allowlist``; None: any)."""
        return PeerAllowlist.parse(self.extra.get(ALLOWLIST_CONFIG_KEY))

    @property
    def conversation_lease(self) -> float | None:
        """D's renewable idle lease (``bidir_kv_lease_seconds``), advertised in its dict."""
        value = self.extra.get(LEASE_CONFIG_KEY)
        return None if value is None else float(value)

    def to_dict(self) -> dict[str, Any]:
        extra = dict(self.extra)
        extra.update(
            bidirectional_kv_xfer=self.bidirectional_kv_xfer,
            kv_recompute_threshold=self.kv_recompute_threshold,
            decoder_kv_blocks_ttl=self.decoder_kv_blocks_ttl,
            kv_lease_duration=self.kv_lease_duration,
            backends=list(self.backends),
            enforce_handshake_compat=self.enforce_handshake_compat,
        )
        return {
            **self.top_level,
            "kv_connector": self.kv_connector,
            "kv_role": self.kv_role,
            "engine_id": self.engine_id,
            "kv_buffer_device": self.kv_buffer_device,
            "kv_load_failure_policy": self.kv_load_failure_policy,
            "kv_connector_extra_config": extra,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def startup_log_line(self) -> str | None:
        """vLLM's INFO line when bidirectional mode is on (missing space included)."""
        if not self.bidirectional_kv_xfer or not threshold_enabled(self.kv_recompute_threshold):
            return None
        return (
            "Bidirectional KV transfer is enabled and the kv recompute threshold is set to "
            f"{self.kv_recompute_threshold} tokens.KV blocks on D are released after a TTL of "
            f"{int(self.decoder_kv_blocks_ttl)} seconds."
        )
