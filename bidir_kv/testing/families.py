"""The model families the conformance catalogue runs over, and what sets them apart.

Each family is a tiny model built locally (``fixtures/tiny_model.py --family``, cached
by ``make conformance-env``) in the shape of a real architecture whose KV cache vLLM
handles differently. A scenario that relies on something a family lacks says so with
``@pytest.mark.requires_model(TRAIT, ...)`` and is not generated for that family; a
scenario where more than one KV cache group matters is marked ``kv_groups`` (landing CI
runs those on the hybrid family too, docs/conformance.md "Model families").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "DEFAULT_FAMILY",
    "FAMILIES",
    "TRAITS",
    "ModelFamily",
    "backend_id",
    "family_named",
    "split_backend_id",
]

# What a scenario may require of a model (``requires_model``), and what each means.
TRAITS: dict[str, str] = {
    "prefix_cache": "the engines keep a local prefix cache (vLLM's CPU platform turns it "
    "off for MLA models)",
    "one_kv_group": "one KV cache group: every layer holds every token's KV (no sliding "
    "window that frees blocks behind it)",
    "kv_groups": "more than one KV cache group (one list of block ids per group in "
    "kv_transfer_params)",
}


@dataclass(frozen=True)
class ModelFamily:
    """One family of tiny models: its name, what real models it is shaped like, the
    traits scenarios may require, and the block size vLLM's CPU platform forces on it
    (``None``: the platform default, 128)."""

    name: str
    shaped_like: str
    traits: frozenset[str]
    block_size: int | None = None
    # KV cache groups vLLM's hybrid allocator makes of it (one list of block ids each
    # in kv_transfer_params; on for NIXL since vLLM PR #41847)
    kv_groups: int = 1

    def has(self, traits: Iterable[str]) -> bool:
        return set(traits) <= self.traits


FAMILIES: dict[str, ModelFamily] = {
    f.name: f
    for f in (
        ModelFamily("dense", "Llama (2 layers)", frozenset({"prefix_cache", "one_kv_group"})),
        ModelFamily(
            "hybrid",
            "Gemma 3 text: sliding-window (256 tokens) and full-attention layers alternating",
            frozenset({"prefix_cache", "kv_groups"}),
            kv_groups=2,
        ),
        ModelFamily(
            "moe",
            "Qwen3-MoE: 8 routed experts, 2 per token, in every layer",
            frozenset({"prefix_cache", "one_kv_group"}),
        ),
        ModelFamily(
            "mla",
            "DeepSeek-V2: multi-head latent attention (kv_lora_rank 512 + rope 64)",
            # vLLM's CPU platform turns prefix caching and chunked prefill off for MLA
            # and its CPU MLA kernel takes 16-token blocks only (vllm/platforms/cpu.py,
            # vllm/v1/attention/backends/mla/cpu_mla.py)
            frozenset({"one_kv_group"}),
            block_size=16,
        ),
    )
}
DEFAULT_FAMILY = "dense"
_SEP = "@"


def family_named(name: str) -> ModelFamily:
    """The family called ``name``; a ``ValueError`` naming the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


def backend_id(backend: str, family: str) -> str:
    """The ``pd`` parametrization id: the backend alone for the dense family (the ids
    CI always had), ``backend@family`` for the others."""
    return backend if family == DEFAULT_FAMILY else f"{backend}{_SEP}{family}"


def split_backend_id(value: str) -> tuple[str, str]:
    """``(backend, family)`` of a :func:`backend_id`."""
    backend, sep, family = value.partition(_SEP)
    return backend, (family if sep else DEFAULT_FAMILY)
