"""Prefill compute by model class, from public measurements (docs/profiles.md §8).

A dense BF16 model's share of peak does not carry over to an FP8 mixture-of-experts
model with latent and sparse attention: at tensor-parallel 8 a prefill of such a model
keeps a much smaller share of the FP8 peak busy. So the rate of a model of this class is
read off measurements of the class, not off the Qwen3-32B fit.

Each :class:`Measurement` is one public figure: the model, the hardware, the
parallelism and precision, the engine, the figure as published, where and when, and
its conversion (written out) to microseconds per prompt token on one 8-GPU node at
``prompt_tokens``. :meth:`Measurement.fraction_of_peak` divides the measured model's
FLOPs per token (its shape, :mod:`bidir_kv.plan.modelcfg`) by that time and the node's
FP8 dense peak: the share a measurement achieves, which is what carries over to
another model of the class. :func:`class_rate` gives the spread: the center is the
median over the sources of the target's own class, the low/high the extremes over every
source of the serving regime; sources of another regime are bounds the spread is
checked against (an expert-parallel, large-batch run is more efficient than a P node
computing one prefill at a time, never less).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bidir_kv.plan.modelcfg import ModelShape, shipped_shape
from bidir_kv.plan.planner import PlanError

__all__ = [
    "BOUNDS",
    "FP8_PEAK_TFLOPS",
    "GLM_FIXED",
    "MEASUREMENTS",
    "ClassRate",
    "FixedMeasurement",
    "Measurement",
    "class_rate",
    "model_class",
    "prefill_flops_per_token",
]

# NVIDIA H100/H200 SXM (and H800: same tensor cores) dense FP8 tensor peak per GPU
FP8_PEAK_TFLOPS = 1979.0

# the serving regimes a measurement comes from
SERIAL = "tp8-serial"  # a TP 8 engine computing one prefill at a time (queued or alone)
EP_BATCH = "ep-batch"  # expert/data parallel attention over large batches (a bound)


def model_class(shape: ModelShape) -> str | None:
    """The class of measurements a shape belongs to (None: no class measured here)."""
    if shape.num_experts and shape.sparse:
        return "moe-mla-dsa"
    if shape.num_experts and shape.attention == "mla":
        return "moe-mla"
    return None


def prefill_flops_per_token(shape: ModelShape, prompt_tokens: float) -> float:
    """FLOPs per token of a prompt of ``prompt_tokens`` computed from context 0: the
    matmuls (and a sparse model's capped attention) plus the context term at the
    prompt's average context ``prompt_tokens / 2`` (the cost model's own form)."""
    return shape.linear_flops_per_token() + shape.context_flops_per_token() * prompt_tokens / 2


@dataclass(frozen=True)
class Measurement:
    """One public prefill measurement and its conversion to µs per token per node."""

    key: str
    config: str  # bidir_kv/data/model_configs/<config>.json: the measured model's shape
    model: str
    model_class: str  # "moe-mla-dsa" (GLM-5's class) or "moe-mla"
    hardware: str
    gpus: int
    parallelism: str
    precision: str
    engine: str
    regime: str
    figure: str  # as published
    url: str
    date: str
    prompt_tokens: int
    us_per_token: tuple[float, float]  # (low, high) per prompt token on the whole node
    conversion: str
    note: str = ""

    def __post_init__(self) -> None:
        lo, hi = self.us_per_token
        if not 0 < lo <= hi:
            raise PlanError(f"measurement {self.key}: us_per_token must be 0 < low <= high")

    @property
    def shape(self) -> ModelShape:
        return shipped_shape(self.config)

    def flops_per_token(self) -> float:
        return prefill_flops_per_token(self.shape, self.prompt_tokens)

    def fraction_of_peak(self) -> tuple[float, float]:
        """(low, high) share of the node's FP8 dense peak the measurement achieves."""
        peak = self.gpus * FP8_PEAK_TFLOPS * 1e12
        lo_us, hi_us = self.us_per_token
        f = self.flops_per_token()
        return f / (hi_us * 1e-6 * peak), f / (lo_us * 1e-6 * peak)

    def midpoint(self) -> float:
        lo, hi = self.fraction_of_peak()
        return (lo * hi) ** 0.5


@dataclass(frozen=True)
class FixedMeasurement:
    """A single-request TTFT at a short prompt: what a request costs beyond its tokens."""

    key: str
    figure: str
    url: str
    date: str
    ttft_ms: float
    prompt_tokens: int
    note: str


MEASUREMENTS: tuple[Measurement, ...] = (
    Measurement(
        key="vllm-recipe-glm5",
        config="glm-5-fp8",
        model="zai-org/GLM-5-FP8",
        model_class="moe-mla-dsa",
        hardware="8x H200",
        gpus=8,
        parallelism="TP 8",
        precision="FP8 weights, bf16 KV (kv_cache_dtype auto)",
        engine="vLLM >= 0.18 (the recipe's image), MTP 3, prefix caching off",
        regime=SERIAL,
        figure="vllm bench serve, 32 prompts of 8,000 random tokens / 1,024 out at 10 req/s: "
        "mean TTFT 13,395 ms, median 14,494 ms, P99 22,952 ms",
        url="https://github.com/vllm-project/recipes/blob/main/GLM/GLM5.md (FP8 Benchmark)",
        date="2026-03 (recipe for vLLM 0.18)",
        prompt_tokens=8000,
        us_per_token=(102.0, 113.0),
        conversion="the 32 arrivals come 0.1 s apart, each prefill S queues behind the "
        "earlier ones: TTFT_k = (k+1) S - 0.1 k; mean (k = 0..31) 16.5 S - 1.55 s = 13.395 s "
        "gives S = 0.906 s, the P99 (k = 31) 32 S - 3.1 s = 22.95 s gives S = 0.814 s; "
        "S / 8,000 tokens = 102-113 µs (an upper bound of the prefill alone: the steps "
        "also carry the decodes of finished prompts)",
    ),
    Measurement(
        key="llm-d-glm52",
        config="glm-5-fp8",
        model="zai-org/GLM-5.2-FP8 (the next release of the family)",
        model_class="moe-mla-dsa",
        hardware="8x H200",
        gpus=8,
        parallelism="llm-d P/D on H200 (wide-EP guide: prefill DEP 8)",
        precision="FP8 weights, FP8 KV",
        engine="vLLM under llm-d",
        regime=SERIAL,
        figure="recompute ~130-144 µs per token",
        url="llm-d's GLM-5.2 H200 benchmark-results page (as recorded in docs/profiles.md §3 "
        "by an earlier session; not re-read in this one)",
        date="2026",
        prompt_tokens=8000,
        us_per_token=(130.0, 144.0),
        conversion="stated per token on the prefill node; the prompt length behind it is "
        "not stated (assumption: 8,000, as the recipe's)",
        note="assumption: GLM-5.2 costs what GLM-5 does per token (same 78 layers, 256 "
        "experts, 8 active, MLA 512 + 64, DSA top-2048)",
    ),
    Measurement(
        key="gpustack-dsv32",
        config="deepseek-v3.2",
        model="deepseek-ai/DeepSeek-V3.2",
        model_class="moe-mla-dsa",
        hardware="8x H200",
        gpus=8,
        parallelism="one node (vLLM baseline without optimizations; TP 8 assumed)",
        precision="FP8 weights",
        engine="vLLM 0.13.0",
        regime=SERIAL,
        figure="very long prompt (32,000 in / 100 out), high concurrency: total 9,709.27 tok/s",
        url="https://docs.gpustack.ai/latest/performance-lab/deepseek-v3.2/h200",
        date="2025-12",
        prompt_tokens=32000,
        us_per_token=(103.0, 103.6),
        conversion="prefill share 32,000 / 32,100 of 9,709.27 tok/s = 9,679 prompt tok/s: "
        "103.3 µs per token; with 8,192-token chunks every step is one prompt's chunk, "
        "so a prefill at a time",
        note="the long-prompt row (4,000 in / 200 out, 9,974.26 tok/s: <= 105.3 µs per "
        "prompt token with the decodes in it) agrees",
    ),
    Measurement(
        key="gpustack-dsr1",
        config="deepseek-v3",
        model="deepseek-ai/DeepSeek-R1-0528 (dense MLA, no DSA)",
        model_class="moe-mla",
        hardware="8x H200",
        gpus=8,
        parallelism="one node (vLLM baseline without optimizations; TP 8 assumed)",
        precision="FP8 weights",
        engine="vLLM 0.11.0",
        regime=SERIAL,
        figure="very long prompt (32,000 in / 100 out), high concurrency: total 15,514.57 tok/s",
        url="https://docs.gpustack.ai/latest/performance-lab/deepseek-r1/h200",
        date="2025-11",
        prompt_tokens=32000,
        us_per_token=(64.4, 65.0),
        conversion="prefill share 32,000 / 32,100 of 15,514.57 tok/s = 15,466 prompt "
        "tok/s: 64.7 µs per token",
        note="the same class without sparse attention: the low end of the range (what "
        "vLLM's latent attention reaches when the DSA indexer and sparse kernels cost "
        "nothing extra)",
    ),
)

# another regime: more efficient than one prefill at a time on a TP 8 node, never less
BOUNDS: tuple[Measurement, ...] = (
    Measurement(
        key="deepseek-h800-ep",
        config="deepseek-v3",
        model="DeepSeek-V3 / R1 (production)",
        model_class="moe-mla",
        hardware="H800 nodes (8 GPUs each)",
        gpus=8,
        parallelism="prefill EP 32, data-parallel attention, two-batch overlap",
        precision="FP8 matmuls, BF16 attention",
        engine="DeepSeek's own",
        regime=EP_BATCH,
        figure="prefill ~73.7k input tok/s per H800 node including cache hits; 56.3 % of "
        "input tokens hit the on-disk KV cache; mean KV length 4,989 in decode",
        url="DeepSeek-V3/R1 inference system overview (open-source week day 6)",
        date="2025-03-01",
        prompt_tokens=5000,
        us_per_token=(30.5, 31.5),
        conversion="computed tokens 73.7k x (1 - 0.563) = 32.2k tok/s per node: 31.1 µs per "
        "computed token; prompt length not stated (assumption: ~5,000, the decode's mean "
        "KV length)",
    ),
    Measurement(
        key="lmsys-96xh100-ep",
        config="deepseek-v3",
        model="DeepSeek-V3",
        model_class="moe-mla",
        hardware="12 nodes of 8x H100 (4 prefill nodes)",
        gpus=8,
        parallelism="P/D, prefill EP 32 with DeepEP, EPLB, two-batch overlap",
        precision="FP8",
        engine="SGLang",
        regime=EP_BATCH,
        figure="52.3k input tok/s per node for 2,000-token inputs",
        url="https://lmsys.org/blog/2025-05-05-large-scale-ep/",
        date="2025-05-05",
        prompt_tokens=2000,
        us_per_token=(19.0, 19.2),
        conversion="1 / 52.3k tok/s = 19.1 µs per token per node",
    ),
)

GLM_FIXED = FixedMeasurement(
    key="sglang-cookbook-glm5-c1",
    figure="GLM-5-FP8 on 8x H200, TP 8, EAGLE, SGLang cookbook: random 1K in / 1K out at "
    "concurrency 1, median TTFT 282 ms (mean 291 ms)",
    url="SGLang GLM-5 cookbook (8x H200), as tabulated in the gist "
    "BenHamm/dcd09f595fef141567a39582f502cef4",
    date="2026-02-13",
    ttft_ms=282.0,
    prompt_tokens=1000,
    note="a request's cost beyond its tokens: the TTFT less the class rate's 1,000 tokens",
)


@dataclass(frozen=True)
class ClassRate:
    """The share of the FP8 peak a model class achieves in one regime, with its spread."""

    model_class: str
    regime: str
    center: float  # median over the class's own sources
    low: float  # the least efficient source of the regime (the slowest prefill)
    high: float  # the most efficient source of the regime
    sources: tuple[str, ...]  # keys behind the center
    spread_sources: tuple[str, ...]  # keys behind low/high

    def factors(self) -> tuple[float, float]:
        """(low, high) multipliers of the per-token cost at ``center``: the fastest and
        the slowest source of the regime."""
        return self.center / self.high, self.center / self.low


def class_rate(
    model_class: str,
    regime: str = SERIAL,
    measurements: tuple[Measurement, ...] = MEASUREMENTS,
    bounds: tuple[Measurement, ...] = BOUNDS,
) -> ClassRate:
    """The center (median of the class's sources) and spread (extremes of the regime).

    Raises :class:`PlanError` when no source of the class is in the regime, or when a
    bound (another regime, more efficient by construction) falls inside the spread.
    """
    regime_sources = [m for m in measurements if m.regime == regime]
    own = [m for m in regime_sources if m.model_class == model_class]
    if not own:
        raise PlanError(f"no public measurement of class {model_class!r} in regime {regime!r}")
    center = statistics.median(m.midpoint() for m in own)
    low = min(m.fraction_of_peak()[0] for m in regime_sources)
    high = max(m.fraction_of_peak()[1] for m in regime_sources)
    for b in bounds:
        if b.fraction_of_peak()[0] < high:
            raise PlanError(
                f"bound {b.key} ({b.fraction_of_peak()[0]:.1%} of peak) is below the "
                f"{regime} spread's high end ({high:.1%}): the sources disagree"
            )
    return ClassRate(
        model_class,
        regime,
        center,
        low,
        high,
        tuple(m.key for m in own),
        tuple(m.key for m in regime_sources),
    )
