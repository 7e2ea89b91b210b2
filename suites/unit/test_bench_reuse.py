"""Rewritten histories and tokens reusable (bench/workload.py, bench/reuse.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from bidir_kv.bench.results import summarize_point
from bidir_kv.bench.reuse import SentTurn, fill_reusable, reusable_tokens
from bidir_kv.bench.stats import RequestRecord
from bidir_kv.bench.workload import HISTORY_MODES, WorkloadError, WorkloadSpec, reply_in_history

REPLY = "alpha beta gamma delta epsilon zeta eta theta"


def test_reply_in_history_modes() -> None:
    assert reply_in_history(REPLY, "verbatim", "k") == REPLY
    replaced = reply_in_history(REPLY, "replaced", "k")
    assert replaced != REPLY and len(replaced.split()) == len(REPLY.split())
    assert replaced == reply_in_history(REPLY, "replaced", "k")  # recorded: the same text
    assert replaced != reply_in_history(REPLY, "replaced", "other")
    half = reply_in_history(REPLY, "half", "k")
    assert REPLY.startswith(half) and len(half) == len(REPLY) // 2
    assert reply_in_history(REPLY, "no-think", "k") == REPLY[len(REPLY) // 2 :].lstrip()
    thinking = "<think>let me see</think>\n\nThe answer."
    assert reply_in_history(thinking, "no-think", "k") == "The answer."
    with pytest.raises(WorkloadError, match="history must be one of"):
        reply_in_history(REPLY, "shuffled", "k")
    with pytest.raises(WorkloadError, match="history must be one of"):
        WorkloadSpec(history="shuffled")
    assert set(HISTORY_MODES) == {"verbatim", "replaced", "half", "no-think"}


def test_reusable_tokens_are_whole_shared_blocks_or_all_of_an_exact_continuation() -> None:
    held = list(range(100, 140))  # 40 tokens: 2 blocks of 16 and a partial one
    assert reusable_tokens(held, [*held, 1, 2], 16) == 40  # exact: the partial block too
    assert reusable_tokens(held, [*held[:35], 7, 8, 9, 10, 11], 16) == 32
    assert reusable_tokens(held, held[:20], 16) == 16  # shorter prompt: whole blocks
    assert reusable_tokens(held, [5, *held], 16) == 0


def _rec(turn: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        ttft_ms=1.0,
        tpot_ms=1.0,
        latency_ms=2.0,
        start_time_ms=0.0,
        input_num_turns=2 * turn - 1,
        input_num_tokens=100,
        output_num_tokens=4,
        output_num_chunks=4,
        output_num_first_chunk_tokens=1,
        approx_cached_percent=0.0,
        conversation_id="c",
        client_id=0,
        leg="on",
        point=32,
        turn=turn,
        ok=ok,
    )


class _Tokenizer:
    """Chat messages as ids: every message's characters, a separator between messages."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        self.calls += 1
        out: list[int] = []
        for m in messages:
            out += [ord(c) for c in m["content"]] + [1]
        return out


def test_fill_reusable_compares_each_prompt_with_the_previous_turns_retained_ids() -> None:
    """Turn 2's prompt repeats turn 1's prompt and reply (verbatim): all of D's retained
    tokens are reusable; turn 3's history cut the reply: whole shared blocks only; a
    turn after a failed one is unknown."""
    user1 = "u" * 30
    reply1 = "abcdefgh"
    messages = [
        {"role": "user", "content": user1},
        {"role": "assistant", "content": reply1},
        {"role": "user", "content": "v" * 5},
        {"role": "assistant", "content": "xy"},  # turn 2's reply cut from "xyzw"
        {"role": "user", "content": "w"},
        {"role": "user", "content": "after a failure"},
    ]
    # what the server generated, as ids (the reply's characters, then its end token 1)
    turns = [
        SentTurn(_rec(1), 1, [ord(c) for c in reply1] + [1]),
        SentTurn(_rec(2), 3, [ord(c) for c in "xyzw"] + [1]),
        SentTurn(_rec(3, ok=False), 5, []),
        SentTurn(_rec(4), 6, [7]),
    ]
    tok = _Tokenizer()
    fill_reusable([(messages, turns)], tok, block_size=8)
    # turn 1's prompt: 31 ids; D retains 31 + 9 - 1 = 39 = turn 2's first 39 ids
    assert turns[0].record.reusable_tokens == 0
    assert turns[1].record.reusable_tokens == 39
    # turn 2's prompt: 46 ids; D retained it + "xyzw"; turn 3's prompt has "xy" then 1
    assert turns[2].record.reusable_tokens == (46 + 2) // 8 * 8
    assert turns[3].record.reusable_tokens is None  # turn 3 failed: nothing known
    assert tok.calls == 4


def test_a_row_sums_reusable_tokens_and_shares_what_was_pulled(tmp_path: Path) -> None:
    recs = [_rec(1), _rec(2), _rec(2)]
    recs[0].reusable_tokens, recs[1].reusable_tokens = 0, 64
    info = {
        "metrics_delta": {
            "prefill0": [
                [
                    "vllm:prompt_tokens_by_source_total",
                    {"source": "external_kv_transfer"},
                    48.0,
                ]
            ]
        }
    }
    row = summarize_point("on", 32, recs, info)
    assert row.tokens_reusable == 64 and row.tokens_external == 48
    assert row.reused_share == pytest.approx(0.75)
    unknown = summarize_point("on", 32, [_rec(2)], info)
    assert unknown.tokens_reusable is None and unknown.reused_share is None
