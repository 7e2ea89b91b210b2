"""One request inside the engine: what was asked, how far it got, and how it ended."""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from bidir_kv.errors import EngineError
from bidir_kv.policy import ROOT_HASH
from bidir_kv.protocol import KVTransferParams
from bidir_kv.wire.ids import RequestId

__all__ = ["Request", "RequestError"]


# The OpenAI-style error type vLLM uses for a status other than 400.
_TYPES = {500: "InternalServerError", 503: "ServiceUnavailableError"}


class RequestError(EngineError):
    """A request the engine refuses (HTTP 400) or fails (HTTP 500, or 503: retry later)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.http_status = status
        self.error_type = _TYPES.get(status, "BadRequestError")
        self.message = message


@dataclass(eq=False)
class Request:
    request_id: RequestId
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    params: KVTransferParams | None = None
    min_tokens: int = 0
    include_stop_str: bool = False
    chain_root: bytes = ROOT_HASH  # parent of the first block hash (cache_salt)
    vocab: Any = None  # sampling.Vocab of the serving tokenizer (None: builtin ids)
    text: Any = None  # sampling.TextState: detokenized output, stop strings
    stop_reason: int | str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    # progress
    tokens: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # the first full-attention group's table
    # the other KV cache groups' tables, by group index (engine/groups.py; empty: one group)
    group_blocks: dict[int, list[int]] = field(default_factory=dict)
    num_computed: int = 0
    cached_tokens: int = 0
    external_tokens: int = 0
    state: str = "waiting"  # waiting | remote | running | finished
    abort_pending: bool = False  # aborted while a READ writes into its blocks
    finish_reason: str | None = None
    error: RequestError | None = None
    out_params: KVTransferParams | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    prefill_started: bool = False  # its per-request prefill costs are charged (steps.py)
    # recompute preemption (steps.py, docs/engine.md "Memory"): how often the request lost
    # its blocks, and the tokens it must compute again before it samples (0: the prompt)
    num_preemptions: int = 0
    resume_tokens: int = 0
    # incremental state of the model runner (compute.py)
    block_chain: list[bytes] = field(default_factory=list)  # policy.block_hashes of tokens
    num_cached_blocks: int = 0  # leading blocks registered in the prefix cache
    slot_hash_pos: int = 0  # slots [0, pos) are folded into slot_hash
    slot_hash: int = 0
    # blake2b over the fingerprints of the first num_digested_blocks (compute.sample)
    kv_digest: Any = field(default_factory=lambda: hashlib.blake2b(digest_size=16))
    num_digested_blocks: int = 0
    events: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def prefill_len(self) -> int:
        """Tokens whose KV is computed before the next sample: the prompt, or after a
        preemption every token so far (prompt and output, as vLLM recomputes them)."""
        return self.resume_tokens or self.prompt_len

    @property
    def is_p_node(self) -> bool:
        return self.params is not None and self.params.do_remote_decode

    @property
    def is_d_node(self) -> bool:
        """D's request: its prompt's KV comes from P (only the tail is computed here)."""
        return self.params is not None and self.params.do_remote_prefill

    @property
    def max_kv_slots(self) -> int:
        """Slots the request can fill: the prompt and every sampled token but the last."""
        return self.prompt_len + max(self.max_tokens, 1) - 1

    def reset_slot_hashes(self) -> None:
        """Forget the running slot hash (recomputed lazily from the start)."""
        self.slot_hash_pos, self.slot_hash = 0, 0

    def reset_kv_digest(self) -> None:
        """Forget the digest of the KV bytes (recomputed lazily from the first block)."""
        self.kv_digest, self.num_digested_blocks = hashlib.blake2b(digest_size=16), 0

    def usage_cached_tokens(self) -> int:
        """``usage.prompt_tokens_details.cached_tokens``: on D, P's own count."""
        p = self.params
        if p is not None and p.do_remote_prefill and p.remote_prefill_cached_tokens is not None:
            return p.remote_prefill_cached_tokens
        return self.cached_tokens
