"""vLLM's default ports that both our emulated engine and a real ``vllm serve`` use."""

from __future__ import annotations

__all__ = ["DEFAULT_SIDE_CHANNEL_PORT"]

# VLLM_NIXL_SIDE_CHANNEL_PORT's default: TP rank r listens on this + r.
DEFAULT_SIDE_CHANNEL_PORT = 5600
