"""Every setting of one emulated engine, with its default written once.

``bidir-kv engine`` reads its flag defaults from here (``EngineSettings.default``),
the assembly (``app.py``) and the scheduler read the values, and launchers can read
the same defaults instead of repeating them. vLLM's protocol defaults (threshold,
TTL, lease) are not here: they belong to ``--kv-transfer-config``
(:class:`~bidir_kv.config.KVTransferConfig`, defaults from :mod:`bidir_kv.policy`).

Light to import on purpose: ``cli.py`` imports it before the flags parse.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from bidir_kv.config import KVTransferConfig
from bidir_kv.engine.faults import Faults
from bidir_kv.engine.profiles import CostProfile
from bidir_kv.policy import KVGroup

__all__ = [
    "DEFAULT_PROFILE",
    "EngineSettings",
    "Pairing",
    "PeerCache",
    "RetainedBlocks",
    "TransportChoice",
    "VllmVersion",
    "ops_from_args",
]

Pairing = Literal["position", "suffix-trim"]
PeerCache = Literal["safe", "vllm"]
RetainedBlocks = Literal["evict", "pin"]
TransportChoice = Literal["auto", "nixl", "tcp"]
VllmVersion = Literal["0.32", "0.33"]
DEFAULT_PROFILE = "tiny"  # the cost profile ``--profile`` loads when not given


@dataclass(kw_only=True)
class EngineSettings:
    """One engine's configuration (field names follow ``vllm serve``'s flags).

    ``None`` means "derived": ``max_num_batched_tokens`` and ``kv_bytes_per_token``
    from the cost profile, ``side_host``/``side_port`` from
    ``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT`` (vLLM's defaults when unset).
    """

    model: str
    served_names: list[str]
    kv: KVTransferConfig
    profile: CostProfile
    host: str = "127.0.0.1"
    port: int = 8000
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_model_len: int = 32768
    max_num_batched_tokens: int | None = None
    # vLLM V1's API-server default for GPUs under 70 GiB (1024 on H100/H200 class,
    # PR #12369; docs/engine.md "Scheduling"): requests running or waiting for a READ
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True  # vLLM V1: on for every generative model
    kv_bytes_per_token: int | None = None
    kv_capacity_tokens: int = 262144
    transport: TransportChoice = "auto"
    emulate_vllm: VllmVersion = "0.33"
    kv_pairing: Pairing = "position"
    side_host: str | None = None
    side_port: int | None = None
    metrics_log_interval: float = 10.0
    kv_verify: bool = True
    kv_guard: bool = True
    # operations (issue 16; docs/engine.md "Operations"): "safe" defaults, vLLM's
    # behaviour one flag away
    retained_blocks: RetainedBlocks = "evict"  # "pin": held until notified/TTL, as vLLM
    max_waiting_seconds: float = 30.0  # a queued request fails with 503 after this; 0 = never
    max_body_bytes: int = 256 * 1024 * 1024  # a larger request body is a 413 (docs/engine.md)
    health_stall_seconds: float = 10.0  # /health is 503 when running work saw no step this long
    peer_cache: PeerCache = "safe"  # "vllm": peers cached by engine id, never re-handshaken
    # the admin endpoints (GET/POST /_emulator/faults, GET /_emulator/state): off unless
    # --enable-admin (open to any caller) or --admin-token (a caller sends it as
    # "Authorization: Bearer TOKEN"); test fixtures and the campaign enable them
    admin: bool = False
    admin_token: str | None = None
    faults: Faults = field(default_factory=Faults)
    tensor_parallel_size: int = 1  # emulated ranks: KV per rank = total / N (docs/engine.md)
    tokenizer: str | None = None  # a local Hugging Face tokenizer dir; None: the builtin one
    # the model's KV cache groups in vLLM's order (engine/groups.py): "full" is a dense
    # model; e.g. "full,sliding_window:128" a hybrid one (the layers split evenly)
    kv_cache_groups: str = "full"

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of field ``name`` (what a flag falls back to)."""
        for f in fields(cls):
            if f.name == name:
                if f.default is not MISSING:
                    return f.default
                if f.default_factory is not MISSING:
                    return f.default_factory()
                raise KeyError(f"EngineSettings.{name} has no default")
        raise KeyError(f"EngineSettings has no field {name!r}")

    @property
    def model_name(self) -> str:
        """The name metrics and responses carry: the first served name."""
        return self.served_names[0]

    @property
    def effective_max_num_batched_tokens(self) -> int:
        """The per-step token budget. Unset, it is the profile's; without chunked
        prefill vLLM raises an unset budget to ``max_model_len`` so every prompt fits."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        budget = self.profile.max_num_batched_tokens
        return budget if self.enable_chunked_prefill else max(budget, self.max_model_len)

    @property
    def effective_kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token or self.profile.kv_bytes_per_token

    @property
    def num_layers(self) -> int:
        return self.profile.num_layers

    @property
    def group_layout(self) -> tuple[KVGroup, ...]:
        """The KV cache groups (``ValueError`` naming the problem for a bad spec)."""
        from bidir_kv.engine.groups import parse_groups

        layout = parse_groups(self.kv_cache_groups, self.block_size)
        if self.num_layers % len(layout):
            raise ValueError(
                f"--kv-cache-groups: {len(layout)} groups do not split the model's "
                f"{self.num_layers} layers evenly (profile {self.profile.name})"
            )
        return layout

    def side_channel(self) -> tuple[str, int]:
        """``(host, port)`` the side channel listens on, derived parts filled in."""
        if self.side_host is not None and self.side_port is not None:
            return self.side_host, self.side_port
        from bidir_kv.engine.transport.sidechannel import side_channel_address

        env_host, env_port = side_channel_address(os.environ)
        return (
            env_host if self.side_host is None else self.side_host,
            env_port if self.side_port is None else self.side_port,
        )


_OPS_FIELDS = (
    "retained_blocks",
    "max_waiting_seconds",
    "max_body_bytes",
    "health_stall_seconds",
    "peer_cache",
    "admin",
    "admin_token",
)


def ops_from_args(ns: Any) -> dict[str, Any]:
    """The operations settings from parsed flags (same names as the fields)."""
    out = {name: getattr(ns, name) for name in _OPS_FIELDS}
    for name in ("max_waiting_seconds", "health_stall_seconds"):
        if out[name] < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {out[name]}")
    if out["max_body_bytes"] < 1:
        raise ValueError(f"--max-body-bytes must be positive, got {out['max_body_bytes']}")
    return out
