"""Per-request records with the field names of vLLM's multi-turn benchmark.

``--stats-json-output`` of ``benchmark_serving_multi_turn.py`` writes a JSON
array of records with exactly the ``VLLM_FIELDS`` below; tools written for it
read ours. Extra fields (leg, point, turn, errors) come after them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "VLLM_FIELDS",
    "RequestRecord",
    "load_records",
    "percentile",
    "write_records",
]

VLLM_FIELDS: tuple[str, ...] = (
    "ttft_ms",
    "tpot_ms",
    "latency_ms",
    "start_time_ms",
    "input_num_turns",
    "input_num_tokens",
    "output_num_tokens",
    "output_num_chunks",
    "output_num_first_chunk_tokens",
    "approx_cached_percent",
    "conversation_id",
    "client_id",
)


@dataclass
class RequestRecord:
    """One request. ``start_time_ms`` is relative to the start of the point's run."""

    ttft_ms: float
    tpot_ms: float
    latency_ms: float
    start_time_ms: float
    input_num_turns: int
    input_num_tokens: int
    output_num_tokens: int
    output_num_chunks: int
    output_num_first_chunk_tokens: int
    approx_cached_percent: float
    conversation_id: str
    client_id: int
    # ours
    leg: str = ""
    point: int = 0
    turn: int = 0
    prompt_tokens: int | None = None
    think_time_s: float = 0.0
    beyond_ttl: bool = False
    ok: bool = True
    error: str | None = None
    # gaps between successive content chunks, ms (vLLM's ``benchmark_serving`` ITL; the
    # multi-turn benchmark keeps only their mean): docs/benchmarking.md "Decode side"
    itl_ms: list[float] = field(default_factory=list)
    # usage.prompt_tokens_details.cached_tokens: prompt tokens P did not compute (its own
    # cache hits and what it read from D); None when the server did not say
    cached_tokens: int | None = None
    # the prompt's longest block-aligned prefix D's retained previous turn holds
    # (bench/reuse.py); None: not known (no token ids, or the previous turn failed)
    reusable_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_records(path: Path, records: Iterable[RequestRecord]) -> None:
    """Atomic write (a Ctrl-C never leaves a truncated file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    # one record per line: a record's ITL list holds a gap per streamed chunk
    lines = ",\n".join(json.dumps(r.to_dict()) for r in records)
    tmp.write_text(f"[\n{lines}\n]\n" if lines else "[]\n")
    tmp.replace(path)


def load_records(path: Path) -> list[RequestRecord]:
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON array of request records")
    out = []
    for i, obj in enumerate(data):
        missing = [f for f in VLLM_FIELDS if f not in obj]
        if missing:
            raise ValueError(f"{path}: record {i} lacks {', '.join(missing)}")
        known = {k: v for k, v in obj.items() if k in RequestRecord.__dataclass_fields__}
        out.append(RequestRecord(**known))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0..100), NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))
