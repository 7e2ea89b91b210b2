"""A published measurement as the fit's second input: the table, its workload, its points.

``bidir_kv/data/published/<profile>.json`` holds the figures a publication gives for one
deployment (mean ms per prefix length: TTFT and router prefill per leg, the KV
transfer) and the workload that produced them. :func:`fit_input` turns them into the
same :class:`~bidir_kv.plan.calibrate.FitInput` a ``bench`` run gives, so
:func:`bidir_kv.plan.calibrate.fit` — the fit behind ``bidir-kv plan --calibration``
— calibrates both (docs/profiles.md §2).

What a table does not say is computed from its workload, with these assumptions
(docs/profiles.md):

* the figures are means over the measured turns: the first ``warmup_fraction`` of each
  conversation's turns are warm-up (the publication drops 20 % of its requests);
* turn ``t`` (0-based) sends ``prefix + input + t × (input + output)`` prompt tokens
  (the chat template's few tokens left out);
* ON: D holds the previous turn's prompt and answer but its last token; P pulls the
  whole blocks of it and computes the rest (the user turn and a partial block);
* the KV transfer is one rank-level transfer per pull (vLLM's ``nixl_xfer_time``),
  reading the model's KV per rank per token, one descriptor per block × layer × KV tensor;
* the published means hold the clients' wait for each other on P; with a decode step
  given, the fit estimates it for closed loops of independent phase
  (``contention.closed_loop_wait_us``) and takes it out of the per-request terms, since
  an emulator running the same clients queues them again.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from typing import Any

from bidir_kv.plan.calibrate import FitInput, OffInput, OnInput, TtftInput
from bidir_kv.plan.modelcfg import ModelShape, shipped_shape

__all__ = [
    "FIGURES",
    "PUBLISHED_DIR",
    "PublishedTable",
    "available_tables",
    "fit_input",
    "load_table",
]

PUBLISHED_DIR: Traversable = files("bidir_kv") / "data" / "published"
# the figures a table may give per prefix length (ms), in the order the demo prints them
FIGURES = ("ttft_off", "ttft_on", "prefill_off", "prefill_on", "kv_transfer")


@dataclass(frozen=True)
class PublishedTable:
    """One publication's figures for one deployment and the workload behind them."""

    name: str
    source: str
    model_config: str
    tp_size: int
    block_size: int
    input_tokens: int
    output_tokens: int
    num_turns: int
    num_clients: int
    warmup_fraction: float
    figures_ms: dict[int, dict[str, float]]  # prefix tokens -> figure -> ms

    def measured_turns(self) -> range:
        """0-based turns after the warm-up."""
        return range(math.ceil(self.warmup_fraction * self.num_turns), self.num_turns)

    def prompt_tokens(self, prefix: int, turn: int) -> int:
        return prefix + self.input_tokens + turn * (self.input_tokens + self.output_tokens)

    def pulled_tokens(self, prefix: int, turn: int) -> int:
        """Tokens P pulls from D on ``turn`` (0 on the first): whole blocks of what D holds."""
        if turn == 0:
            return 0
        held = self.prompt_tokens(prefix, turn - 1) + self.output_tokens - 1
        return held // self.block_size * self.block_size

    def mean_prompt_tokens(self, prefix: int) -> float:
        turns = self.measured_turns()
        return sum(self.prompt_tokens(prefix, t) for t in turns) / len(turns)

    def mean_pulled_tokens(self, prefix: int) -> float:
        turns = self.measured_turns()
        return sum(self.pulled_tokens(prefix, t) for t in turns) / len(turns)

    def shape(self) -> ModelShape:
        return shipped_shape(self.model_config)

    def figure(self, prefix: int, name: str) -> float | None:
        return self.figures_ms.get(prefix, {}).get(name)


def available_tables() -> list[str]:
    return sorted(
        p.name.removesuffix(".json") for p in PUBLISHED_DIR.iterdir() if p.name.endswith(".json")
    )


def _table(data: dict[str, Any]) -> PublishedTable:
    work = data["workload"]
    return PublishedTable(
        name=str(data["name"]),
        source=str(data["source"]),
        model_config=str(data["model_config"]),
        tp_size=int(data["tp_size"]),
        block_size=int(data["block_size"]),
        input_tokens=int(work["input_tokens"]),
        output_tokens=int(work["output_tokens"]),
        num_turns=int(work["num_turns"]),
        num_clients=int(work["num_clients"]),
        warmup_fraction=float(work["warmup_fraction"]),
        figures_ms={
            int(k): {f: float(v) for f, v in row.items() if f in FIGURES}
            for k, row in data["figures_ms"].items()
        },
    )


def load_table(name: str) -> PublishedTable | None:
    """The published table for profile ``name`` (a shipped name or a profile path's
    stem), or ``None`` when no publication measured that deployment."""
    stem = name.rsplit("/", 1)[-1].removesuffix(".json")
    path = PUBLISHED_DIR / f"{stem}.json"
    if not path.is_file():
        return None
    return _table(json.loads(path.read_text()))


def fit_input(table: PublishedTable, decode_us_per_token: float = 0.0) -> FitInput:
    """The table as the fit's input: one OFF and one ON point per prefix length.

    ``decode_us_per_token`` (the deployment's decode step with the table's clients in
    the batch) makes each client's turn outside P's prefill ``output_tokens`` steps, so
    the fit can take the clients' wait for each other out of the published means; 0
    leaves it in the per-request terms."""
    shape = table.shape()
    tp = table.tp_size
    rank_bytes = shape.kv_bytes_per_token_per_rank(tp)
    per_block = shape.num_layers * shape.kv_tensors_per_layer()
    off: list[OffInput] = []
    on: list[OnInput] = []
    ttft: list[TtftInput] = []
    for prefix in sorted(table.figures_ms):
        prompt = table.mean_prompt_tokens(prefix)
        pulled = table.mean_pulled_tokens(prefix)
        f = table.figures_ms[prefix]
        if "prefill_off" in f:
            off.append(OffInput(prefix, f["prefill_off"] * 1e3, prompt))
            if "ttft_off" in f:
                ttft.append(
                    TtftInput(prefix, "off", prompt, f["ttft_off"] * 1e3, f["prefill_off"] * 1e3)
                )
        if "prefill_on" in f and "kv_transfer" in f:
            on.append(
                OnInput(
                    point=prefix,
                    prefill_us=f["prefill_on"] * 1e3,
                    computed_per_request=prompt - pulled,
                    pulls_per_request=1.0,
                    tokens_per_pull=pulled,
                    xfer_us=f["kv_transfer"] * 1e3,
                    xfer_bytes=pulled * rank_bytes,
                    xfer_descriptors=pulled / table.block_size * per_block,
                    xfer_count=float(tp),
                    tokens_external=pulled,
                )
            )
            if "ttft_on" in f:
                ttft.append(
                    TtftInput(prefix, "on", prompt, f["ttft_on"] * 1e3, f["prefill_on"] * 1e3)
                )
    return FitInput(
        source=f"fitted to the published table {table.name}",
        off=tuple(off),
        on=tuple(on),
        ttft=tuple(ttft),
        tp=tp,
        ctx_ratio=shape.context_flops_per_token() * 1000 / shape.linear_flops_per_token(),
        num_clients=table.num_clients,
        rest_us=table.output_tokens * decode_us_per_token,
    )
