"""Workload: deterministic conversations, exact token counts, think-time draws."""

from __future__ import annotations

import random

import pytest

from bidir_kv.bench.distributions import Distribution, DistributionError
from bidir_kv.bench.workload import (
    WorkloadError,
    WorkloadSpec,
    build_conversations,
    count_words,
    fit_text,
)


def byte_count(text: str) -> int:
    """A byte-level tokenizer, like the emulator's and the tiny vLLM model's BPE at worst."""
    return len(text.encode())


def test_same_seed_same_conversations() -> None:
    spec = WorkloadSpec(
        prefix_tokens=300,
        num_conversations=3,
        num_turns=4,
        input_tokens=20,
        think_time=Distribution.parse("exp:2"),
        seed=7,
    )
    a = build_conversations(spec, byte_count)
    b = build_conversations(spec, byte_count)
    assert a == b
    c = build_conversations(WorkloadSpec(**{**spec.__dict__, "seed": 8}), byte_count)
    assert [t.content for t in a[0].turns] != [t.content for t in c[0].turns]


def test_conversations_do_not_share_text() -> None:
    convs = build_conversations(
        WorkloadSpec(prefix_tokens=200, num_conversations=4, num_turns=2, input_tokens=10),
        byte_count,
    )
    firsts = [c.turns[0].content for c in convs]
    assert len(set(firsts)) == 4
    # no two conversations share even their first block of 16 tokens
    assert len({f[:16] for f in firsts}) == 4
    assert len({c.conversation_id for c in convs}) == 4


@pytest.mark.parametrize("counter", [byte_count, count_words])
@pytest.mark.parametrize("target", [1, 7, 150, 2150, 8150])
def test_fit_text_is_exact(counter, target: int) -> None:
    text, n = fit_text(target, random.Random(target), counter, head="turn 1:")
    assert n == target
    assert counter(text) == target


def test_token_counts_follow_the_spec() -> None:
    spec = WorkloadSpec(
        prefix_tokens=500, num_conversations=2, num_turns=3, input_tokens=40, output_tokens=9
    )
    for conv in build_conversations(spec, byte_count):
        assert [t.content_tokens for t in conv.turns] == [540, 40, 40]
        assert all(t.max_tokens == 9 for t in conv.turns)
        assert conv.turns[0].think_time_s == 0.0


def test_beyond_ttl_gaps() -> None:
    spec = WorkloadSpec(
        prefix_tokens=10,
        num_conversations=50,
        num_turns=3,
        input_tokens=5,
        beyond_ttl_fraction=0.5,
        beyond_ttl_gap_s=99.0,
        seed=1,
    )
    turns = [t for c in build_conversations(spec) for t in c.turns[1:]]
    beyond = [t for t in turns if t.beyond_ttl]
    assert 20 < len(beyond) < 80  # ~50 of 100
    assert all(t.think_time_s == 99.0 for t in beyond)
    assert all(t.think_time_s == 0.0 for t in turns if not t.beyond_ttl)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_turns": 0},
        {"input_tokens": 0},
        {"prefix_tokens": -1},
        {"beyond_ttl_fraction": 2.0},
        {"beyond_ttl_fraction": 0.1},
    ],
)
def test_bad_workload_is_named(kwargs) -> None:
    with pytest.raises(WorkloadError):
        WorkloadSpec(**kwargs)


def test_distributions() -> None:
    rng = random.Random(0)
    assert Distribution.parse("const:3").sample(rng) == 3.0
    assert Distribution.parse(2.5).mean() == 2.5
    u = Distribution.parse("uniform:1,3")
    assert all(1 <= u.sample(rng) <= 3 for _ in range(100))
    e = Distribution.parse("exp:10")
    draws = [e.sample(rng) for _ in range(4000)]
    assert 9 < sum(draws) / len(draws) < 11
    assert e.cdf(e.quantile(0.9)) == pytest.approx(0.9)
    ln = Distribution.parse("lognormal:30,1")
    assert ln.cdf(30) == pytest.approx(0.5)
    assert ln.cdf(ln.quantile(0.95)) == pytest.approx(0.95, abs=1e-6)
    # E[min(X, cap)] for exp(mean m) is m (1 - e^(-cap/m)); numeric path agrees for uniform
    assert e.mean_truncated(10) == pytest.approx(10 * (1 - 2.718281828**-1), rel=1e-6)
    assert u.mean_truncated(2) == pytest.approx(1 + 0.75, rel=1e-4)
    for bad in ("exp", "exp:1,2", "nope:1", "uniform:3,1", "exp:-1", "const:x"):
        with pytest.raises(DistributionError):
            Distribution.parse(bad)
