"""Model shape from a Hugging Face ``config.json``: KV bytes per token and FLOPs per token.

Handles the two KV layouts bidirectional transfer moves:

* GQA/MHA: per layer ``2 × num_key_value_heads × head_dim`` values per token, split
  across tensor-parallel ranks by KV head (replicated when TP > KV heads).
* MLA (DeepSeek-V2/V3 style, GLM-5): per layer one latent of
  ``kv_lora_rank + qk_rope_head_dim`` values per token, replicated on every TP rank.
  DeepSeek-style sparse attention (``index_topk``) adds an indexer key cache of
  ``index_head_dim`` FP8 values plus a 4-byte scale per layer, and caps the
  attended context at ``index_topk`` tokens.

The KV cache dtype is vLLM's ``--kv-cache-dtype`` as the server resolves it
(docs/profiles.md §4): ``auto`` is the model's dtype; an FP8 cache of a
sparse-MLA model is vLLM's ``fp8_ds_mla`` layout (512 FP8 latent values, four
float32 scales, 64 bf16 RoPE values: 656 B per layer).

Parameter counts are estimated from the shapes (the checks in
``suites/unit/test_bench_plan.py`` reproduce the published totals).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from bidir_kv.errors import ConfigError

__all__ = [
    "CONFIG_DIR",
    "ModelConfigError",
    "ModelShape",
    "load_model_config",
    "model_shape",
    "shipped_shape",
]

# the shipped configs: package data (pyproject.toml [tool.setuptools.package-data])
CONFIG_DIR: Traversable = files("bidir_kv") / "data" / "model_configs"

_DTYPE_BYTES = {
    "float32": 4.0,
    "float16": 2.0,
    "bfloat16": 2.0,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
    "fp8_ds_mla": 1.0,
    "float8_e4m3fn": 1.0,
    "float8": 1.0,
}
# vLLM's fp8_ds_mla layout of one sparse-MLA latent per token and layer: 512 FP8 values,
# 4 float32 scales (one per 128 values), 64 bf16 RoPE values (vLLM's DeepSeek-V3.2 blog;
# FlashMLASparseBackend in vLLM 0.29's v1/attention/backends/mla/flashmla_sparse.py)
FP8_DS_MLA_BYTES = 656
# the DSA indexer's key cache per token and layer: index_head_dim FP8 values plus one
# float32 scale per 128 (vLLM 0.29 models/deepseek_v32/attention.py: head_dim +
# head_dim // quant_block_size * 4), whatever the attention's KV dtype
INDEXER_QUANT_BLOCK = 128
# the one block size vLLM's sparse-MLA backends support on Hopper (FLASH_ATTN_MLA_SPARSE,
# FLASHMLA_SPARSE: get_supported_kernel_block_sizes() == [64]); the server picks it when
# --block-size is not given (platforms/interface.py update_block_size_for_backend)
SPARSE_MLA_BLOCK_SIZE = 64


class ModelConfigError(ConfigError):
    """A config.json that lacks what the planner needs; the message names the key."""


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    attention: str  # "gqa" or "mla"
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_head_dim: int
    index_n_heads: int
    index_topk: int
    kv_dtype_bytes: float
    total_params: float
    active_params: float  # per token, excluding the embedding lookup
    kv_cache_dtype: str = "bfloat16"  # as the server resolves --kv-cache-dtype
    num_experts: int = 0  # routed experts per MoE layer (0: a dense model)

    @property
    def sparse(self) -> bool:
        """DeepSeek-style sparse attention (an indexer picks ``index_topk`` tokens)."""
        return self.attention == "mla" and self.index_topk > 0

    def indexer_bytes_per_token_layer(self) -> float:
        """The indexer's key cache per token and layer (FP8 values + float32 scales)."""
        if not self.sparse:
            return 0.0
        scales = -(-self.index_head_dim // INDEXER_QUANT_BLOCK)
        return self.index_head_dim * 1.0 + 4.0 * scales

    def latent_bytes_per_token_layer(self) -> float:
        """One MLA latent per token and layer, in the served KV dtype."""
        if self.sparse and self.kv_cache_dtype == "fp8_ds_mla":
            return float(FP8_DS_MLA_BYTES)
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_dtype_bytes

    def served_block_size(self, default: int) -> int:
        """The KV block size a server uses for this model when none is given: sparse MLA
        on Hopper runs only with 64-token blocks; everything else keeps ``default``."""
        return SPARSE_MLA_BLOCK_SIZE if self.sparse else default

    def kv_bytes_per_token_per_rank(self, tp: int = 1) -> float:
        """KV bytes one TP rank holds (and reads) per token, all layers."""
        if tp < 1:
            raise ModelConfigError(f"tensor parallel size must be >= 1, got {tp}")
        if self.attention == "mla":
            per_layer = self.latent_bytes_per_token_layer() + self.indexer_bytes_per_token_layer()
            return self.num_layers * per_layer
        heads_per_rank = max(1, -(-self.num_kv_heads // tp))
        return self.num_layers * 2 * heads_per_rank * self.head_dim * self.kv_dtype_bytes

    def kv_tensors_per_layer(self) -> int:
        """Separate KV tensors per layer, each one RDMA descriptor per block in vLLM's NIXL
        connector: K and V for GQA; the latent (plus the indexer keys) for MLA."""
        if self.attention == "mla":
            return 2 if self.index_topk else 1
        return 2

    def kv_bytes_per_token(self, tp: int = 1) -> float:
        """KV bytes per token summed over the TP group (what moves and what is held)."""
        return self.kv_bytes_per_token_per_rank(tp) * tp

    def linear_flops_per_token(self) -> float:
        """2 × active parameters (matmuls), plus attention at the sparse cap if any."""
        flops = 2.0 * self.active_params
        if self.index_topk:
            flops += self.index_topk * self.attention_flops_per_context_token()
        return flops

    def attention_flops_per_context_token(self) -> float:
        """FLOPs one new token spends per earlier token it attends to (QKᵀ and AV).

        Dense MLA prefill runs as multi-head attention on the decompressed heads
        (``qk_nope + qk_rope`` and ``v_head_dim``); sparse MLA attends in the latent
        space (queries absorbed: keys of ``kv_lora_rank + qk_rope_head_dim``, values of
        ``kv_lora_rank``), as vLLM's sparse-MLA kernels do (head size 576 for 512 + 64).
        """
        if self.sparse:
            qk = self.kv_lora_rank + self.qk_rope_head_dim
            return 2.0 * self.num_layers * self.num_attention_heads * (qk + self.kv_lora_rank)
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            return 2.0 * self.num_layers * self.num_attention_heads * (qk + self.v_head_dim)
        return 4.0 * self.num_layers * self.num_attention_heads * self.head_dim

    def context_flops_per_token(self) -> float:
        """FLOPs per new token that grow linearly with context (per context token)."""
        if self.index_topk:
            # dense attention is capped at index_topk; the indexer still scans all context
            return 2.0 * self.num_layers * self.index_n_heads * self.index_head_dim
        return self.attention_flops_per_context_token()


def load_model_config(path: Path | Traversable) -> dict[str, Any]:
    """A ``config.json`` (a file path, or a shipped config under ``bidir_kv/data``) as a
    dict; ``_name`` is its directory's name for a ``config.json``, else the file's stem."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{path}: cannot read a JSON config: {exc}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: config.json must hold a JSON object")
    if isinstance(path, Path) and path.name == "config.json":
        data.setdefault("_name", path.parent.name)
    data.setdefault("_name", Path(path.name).stem)
    return data


def _req(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _opt(cfg: Mapping[str, Any], key: str, default: int = 0) -> int:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelConfigError(f"config.json: {key} must be a non-negative integer, got {value!r}")
    return value


def model_shape(config: Mapping[str, Any], kv_dtype: str | None = None) -> ModelShape:
    """Read the shape from a config (``text_config`` is used when present)."""
    cfg: Mapping[str, Any] = config.get("text_config") or config
    layers = _req(cfg, "num_hidden_layers")
    hidden = _req(cfg, "hidden_size")
    heads = _req(cfg, "num_attention_heads")
    vocab = _req(cfg, "vocab_size")
    model_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    dtype = model_dtype if kv_dtype in (None, "auto") else str(kv_dtype)
    if dtype not in _DTYPE_BYTES:
        raise ModelConfigError(
            f"KV cache dtype {dtype!r} unknown; use auto or one of "
            f"{', '.join(sorted(_DTYPE_BYTES))}"
        )
    mla = bool(cfg.get("kv_lora_rank"))
    if mla and _opt(cfg, "index_topk") and dtype.startswith("fp8"):
        dtype = "fp8_ds_mla"  # vLLM stores a sparse-MLA FP8 cache in its own layout
    elif dtype == "fp8_ds_mla":
        raise ModelConfigError("KV cache dtype fp8_ds_mla is only for sparse-MLA models")
    kv_heads = _opt(cfg, "num_key_value_heads", heads) or heads
    head_dim = _opt(cfg, "head_dim") or hidden // heads
    kv_lora = _opt(cfg, "kv_lora_rank")
    rope = _opt(cfg, "qk_rope_head_dim")
    nope = _opt(cfg, "qk_nope_head_dim")
    v_dim = _opt(cfg, "v_head_dim", head_dim) or head_dim
    if mla and not rope:
        raise ModelConfigError("config.json: an MLA config (kv_lora_rank) needs qk_rope_head_dim")

    # attention parameters per layer
    if mla:
        q_lora = _opt(cfg, "q_lora_rank")
        qk = nope + rope
        q = hidden * q_lora + q_lora * heads * qk if q_lora else hidden * heads * qk
        attn = (
            q
            + hidden * (kv_lora + rope)
            + kv_lora * heads * (nope + v_dim)
            + heads * v_dim * hidden
        )
    else:
        attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    # MLP parameters per layer (dense, or routed + shared experts)
    experts = _opt(cfg, "n_routed_experts") or _opt(cfg, "num_experts")
    inter = _opt(cfg, "intermediate_size")
    if experts:
        moe_inter = _req(cfg, "moe_intermediate_size")
        top_k = _req(cfg, "num_experts_per_tok")
        shared_inter = _opt(cfg, "shared_expert_intermediate_size") or (
            _opt(cfg, "n_shared_experts") * moe_inter
        )
        dense_layers = _opt(cfg, "first_k_dense_replace")
        moe_layers = layers - dense_layers
        expert = 3 * hidden * moe_inter
        mlp_total = dense_layers * 3 * hidden * inter + moe_layers * (
            experts * expert + 3 * hidden * shared_inter + hidden * experts
        )
        mlp_active = dense_layers * 3 * hidden * inter + moe_layers * (
            top_k * expert + 3 * hidden * shared_inter + hidden * experts
        )
    else:
        if not inter:
            raise ModelConfigError("config.json: intermediate_size is required for a dense model")
        mlp_total = mlp_active = layers * 3 * hidden * inter
    embed = vocab * hidden
    lm_head = 0 if cfg.get("tie_word_embeddings") else vocab * hidden
    total = layers * attn + mlp_total + embed + lm_head
    active = layers * attn + mlp_active + vocab * hidden  # the LM head matmul always runs
    return ModelShape(
        name=str(config.get("_name") or cfg.get("model_type") or "model"),
        num_layers=layers,
        attention="mla" if mla else "gqa",
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=nope,
        v_head_dim=v_dim,
        index_head_dim=_opt(cfg, "index_head_dim"),
        index_n_heads=_opt(cfg, "index_n_heads"),
        index_topk=_opt(cfg, "index_topk"),
        kv_dtype_bytes=_DTYPE_BYTES[dtype],
        total_params=float(total),
        active_params=float(active),
        kv_cache_dtype=dtype,
        num_experts=experts,
    )


@cache
def shipped_shape(name: str, kv_dtype: str | None = None) -> ModelShape:
    """The shape of a shipped config, ``bidir_kv/data/model_configs/<name>.json``."""
    return model_shape(load_model_config(CONFIG_DIR / f"{name}.json"), kv_dtype)
