"""Cost-model profiles: how long the emulated engine *pretends* work takes.

A profile never changes what goes over the wire (design invariant 3); it only
sets compute and transfer durations. Profiles are JSON files shipped in the package,
``bidir_kv/data/profiles/`` (derivations in ``docs/profiles.md``), read through
``importlib.resources`` so an installed wheel finds them. Real KV bytes are
still moved, scaled down to ``kv_bytes_per_token``; the emulated transfer time
is computed from the *target's* terms (``pull_model``: fixed, per descriptor, bytes
per rank over the achieved rank bandwidth), so the ratio of recompute time to pull
time matches the target. ``sources`` says where each term comes from.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from bidir_kv.engine.pull_model import PullModel
from bidir_kv.errors import ConfigError

__all__ = [
    "PROFILE_DIR",
    "UNCERTAIN_TERMS",
    "CostProfile",
    "ProfileError",
    "TermRange",
    "available_profiles",
    "load_profile",
]

# the shipped profiles: package data (pyproject.toml [tool.setuptools.package-data])
PROFILE_DIR: Traversable = files("bidir_kv") / "data" / "profiles"


class ProfileError(ConfigError):
    """Unknown profile name or a malformed profile file."""


# the cost terms a profile may give a range for (the planner scales them, docs/profiles.md
# §5): recompute (both prefill rates), pull (bytes and descriptors per pulled token),
# pull_fixed (per pull), pull_after (P's work per pulled token), prefill_fixed (per
# request), decode_part (D's part of TTFT). The emulator runs the profile's values.
UNCERTAIN_TERMS = (
    "recompute",
    "pull",
    "pull_fixed",
    "pull_after",
    "prefill_fixed",
    "decode_part",
)


@dataclass(frozen=True)
class TermRange:
    """How uncertain one cost term is: multipliers of the profile's value, low <= 1 <= high,
    and where the spread comes from."""

    term: str
    low: float
    high: float
    source: str = ""

    def __post_init__(self) -> None:
        if self.term not in UNCERTAIN_TERMS:
            raise ProfileError(
                f"uncertainty term {self.term!r} unknown; use one of {', '.join(UNCERTAIN_TERMS)}"
            )
        if not 0 < self.low <= 1 <= self.high:
            raise ProfileError(
                f"uncertainty of {self.term}: need 0 < low <= 1 <= high, got "
                f"{self.low:g}..{self.high:g}"
            )


@dataclass(frozen=True)
class CostProfile:
    name: str
    description: str = ""
    # compute (target hardware), microseconds
    prefill_us_per_token: float = 0.0  # linear part of prefill
    prefill_us_per_token_ctx: float = 0.0  # attention part: per new token per 1k context tokens
    # per request whose prompt P computes (not D's tail after a P->D pull): scheduling,
    # per-layer collective latency at TP N, sampling
    prefill_fixed_us: float = 0.0
    decode_us_per_step: float = 0.0  # one decode step, batch of 1
    decode_us_per_seq: float = 0.0  # extra per additional sequence in the batch
    max_num_batched_tokens: int = 8192
    # KV sizes
    kv_bytes_per_token_target: int = 0  # what the real model holds per token (all layers)
    kv_bytes_per_token: int = 64  # what the emulator really stores and moves per token
    num_layers: int = 2  # emulated layers (KV content is derived per layer)
    # transfer (target network), see bidir_kv.engine.pull_model
    transfer_overhead_us: float = 0.0  # fixed cost per pull (descriptor build, post, notify)
    transfer_gbytes_per_s: float = 0.0  # whole TP group; used if rail_gbytes_per_s is 0
    transfer_per_descriptor_us: float = 0.0  # submission cost of one RDMA descriptor
    rail_gbytes_per_s: float = 0.0  # achieved bandwidth of one rank-level transfer per rail
    rails_per_rank: int = 1  # network rails one rank's transfer uses
    tp_size: int = 1  # target ranks pulling in parallel (kv_bytes_per_token_target / tp_size each)
    target_block_size: int = 16  # the target's KV block size (descriptor granularity)
    descriptors_per_block: int = 0  # per rank: layers × KV tensors
    step_us: float = 0.0  # one idle engine step (the pull's completion is seen at a step)
    handshake_us: float = 0.0  # first pull between a new P/D pair
    # P's own work per token it pulled from D (descriptor preparation, block
    # bookkeeping, the step that sees the READ complete), in the step that computes
    # the rest of that prefill
    pull_after_us_per_token: float = 0.0
    # D's part of TTFT (beyond P's prefill): fixed + per prompt token. When either is
    # set, D's P->D pull takes this less one decode step (D's own first step) instead
    # of the wire model; both 0: the wire model (docs/profiles.md)
    decode_ttft_fixed_us: float = 0.0
    decode_ttft_us_per_token: float = 0.0
    sources: tuple[str, ...] = ()  # where each term comes from (docs/profiles.md)
    # the planner's ranges: how far each uncertain term may be from its value
    uncertainty: tuple[TermRange, ...] = ()
    # global scale applied to every emulated duration (keeps ratios, shortens runs)
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
                raise ProfileError(f"profile {self.name!r}: {f.name} must be >= 0, got {value}")
        if self.kv_bytes_per_token <= 0:
            raise ProfileError(f"profile {self.name!r}: kv_bytes_per_token must be > 0")
        if self.num_layers <= 0 or self.kv_bytes_per_token % self.num_layers:
            raise ProfileError(
                f"profile {self.name!r}: kv_bytes_per_token ({self.kv_bytes_per_token}) must be "
                f"a positive multiple of num_layers ({self.num_layers})"
            )
        if self.max_num_batched_tokens <= 0:
            raise ProfileError(f"profile {self.name!r}: max_num_batched_tokens must be > 0")
        for name in ("rails_per_rank", "tp_size", "target_block_size"):
            if getattr(self, name) <= 0:
                raise ProfileError(f"profile {self.name!r}: {name} must be > 0")

    @property
    def pull_model(self) -> PullModel:
        """The target's pull terms, unscaled (``time_scale`` applies to the seconds below)."""
        if self.rail_gbytes_per_s > 0:
            rank_bw = self.rail_gbytes_per_s * self.rails_per_rank
        else:  # older profiles: one effective bandwidth for the whole group
            rank_bw = self.transfer_gbytes_per_s / self.tp_size
        return PullModel(
            fixed_us=self.transfer_overhead_us,
            per_descriptor_us=self.transfer_per_descriptor_us,
            rank_bytes_per_token=self.kv_bytes_per_token_target / self.tp_size,
            rank_gbytes_per_s=rank_bw,
            block_size=self.target_block_size,
            descriptors_per_block=self.descriptors_per_block,
            step_us=self.step_us,
            handshake_us=self.handshake_us,
        )

    # ---- durations, seconds ---------------------------------------------------

    def prefill_seconds(self, new_tokens: int, context_tokens: int = 0) -> float:
        """Compute time for ``new_tokens`` prompt tokens after ``context_tokens`` cached ones."""
        if new_tokens <= 0:
            return 0.0
        avg_ctx = context_tokens + new_tokens / 2
        us = new_tokens * (
            self.prefill_us_per_token + self.prefill_us_per_token_ctx * avg_ctx / 1000
        )
        return us * 1e-6 * self.time_scale

    def prefill_fixed_seconds(self) -> float:
        """Per-request fixed part of a prefill P computes (charged once per request)."""
        return self.prefill_fixed_us * 1e-6 * self.time_scale

    def pull_after_seconds(self, pulled_tokens: int) -> float:
        """P's own work on ``pulled_tokens`` it read from D, beyond the READ itself."""
        return max(0, pulled_tokens) * self.pull_after_us_per_token * 1e-6 * self.time_scale

    def decode_pull_seconds(self, prompt_tokens: int) -> float | None:
        """How long D's P->D pull takes for a prompt of ``prompt_tokens``, or ``None``
        for the wire model (``transfer_seconds``).

        With D's part of TTFT set, the pull is that part less one decode step: the
        step loop spends the step itself when D samples the first token."""
        if not (self.decode_ttft_fixed_us or self.decode_ttft_us_per_token):
            return None
        part = self.decode_ttft_fixed_us + self.decode_ttft_us_per_token * max(0, prompt_tokens)
        return max(0.0, part - self.decode_us_per_step) * 1e-6 * self.time_scale

    def decode_step_seconds(self, batch: int) -> float:
        if batch <= 0:
            return 0.0
        us = self.decode_us_per_step + self.decode_us_per_seq * (batch - 1)
        return us * 1e-6 * self.time_scale

    def transfer_seconds(self, tokens: int) -> float:
        """Emulated post-to-completion time of pulling ``tokens`` tokens (whole blocks).

        Excludes the step granularity (``step_seconds``: the engine's step loop adds
        it) and the first-pull handshake (``handshake_seconds``).
        """
        return self.pull_model.wire_us(tokens) * 1e-6 * self.time_scale

    def descriptors(self, tokens: int) -> int:
        """RDMA descriptors one target rank posts for a pull of ``tokens`` tokens."""
        return self.pull_model.descriptors(tokens)

    @property
    def step_seconds(self) -> float:
        return self.step_us * 1e-6 * self.time_scale

    @property
    def handshake_seconds(self) -> float:
        return self.handshake_us * 1e-6 * self.time_scale

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["sources"] = list(self.sources)
        d["uncertainty"] = [asdict(t) for t in self.uncertainty]
        return d


def available_profiles() -> list[str]:
    return sorted(Path(p.name).stem for p in PROFILE_DIR.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str) -> CostProfile:
    """Load a shipped profile by name (``bidir_kv/data/profiles/<name>.json``) or a
    JSON file path."""
    given = Path(name_or_path)
    path = given if given.suffix else PROFILE_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise ProfileError(
            f"unknown profile {name_or_path!r}; available: {', '.join(available_profiles())}"
        )
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ProfileError(f"profile file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"profile file {path} must hold a JSON object")
    known = {f.name for f in fields(CostProfile)}
    unknown = sorted(set(data) - known - {"derivation"})
    if unknown:
        raise ProfileError(f"profile file {path}: unknown keys {unknown}")
    data.pop("derivation", None)
    data.setdefault("name", Path(path.name).stem)
    if isinstance(data.get("sources"), list):
        data["sources"] = tuple(str(x) for x in data["sources"])
    if "uncertainty" in data:
        data["uncertainty"] = _term_ranges(path, data["uncertainty"])
    try:
        return CostProfile(**data)
    except TypeError as exc:
        raise ProfileError(f"profile file {path}: {exc}") from None


def _term_ranges(path: Path | Traversable, raw: Any) -> tuple[TermRange, ...]:
    if not isinstance(raw, list) or not all(isinstance(x, dict) for x in raw):
        raise ProfileError(f"profile file {path}: uncertainty must be a list of objects")
    out = []
    for item in raw:
        try:
            out.append(
                TermRange(
                    str(item["term"]),
                    float(item["low"]),
                    float(item["high"]),
                    str(item.get("source", "")),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(
                f"profile file {path}: uncertainty entry {item!r} needs term, low, high ({exc})"
            ) from None
    terms = [t.term for t in out]
    if len(set(terms)) != len(terms):
        raise ProfileError(f"profile file {path}: an uncertainty term is given twice")
    return tuple(out)
