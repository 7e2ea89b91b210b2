"""The hardware tier's publication-shaped measurement (conversations of several turns by
concurrent clients, every turn >= 2 measured OFF and ON) on an emulated pair: the code the
GPU default runs, exercised here where no GPU is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bidir_kv.launch.process import free_port
from bidir_kv.testing.emulated_read import BLOCK, KV_BYTES_PER_TOKEN, LocalNodes, node_spec
from bidir_kv.testing.hardware import HwDeployment, measure_conversations
from bidir_kv.testing.hw_gates import LengthResult, gate_mechanism, gate_tpot


@pytest.fixture
def emulated(run_dir: Path) -> Iterator[HwDeployment]:
    nodes = LocalNodes(run_dir)
    lo = "127.0.0.1"
    try:
        d = nodes.start(node_spec("decode", lo, lo, free_port(), free_port()))
        p = nodes.start(node_spec("prefill", lo, lo, free_port(), free_port()))
        yield HwDeployment(
            kind="emulator",
            prefill=p,
            decode=d,
            block_size=BLOCK,
            threshold=64,
            token_range=(10, 1000),
            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        )
    finally:
        nodes.close()


def test_conversations_by_two_clients_measure_every_later_turn(emulated: HwDeployment) -> None:
    res = LengthResult(history_tokens=512, prompt_tokens=0)
    measure_conversations(emulated, 512, res, conversations=3, turns=4, clients=2, answer_tokens=24)
    assert len(res.on_s) == len(res.off_s) == 3 * 3
    # each later turn reads back the whole conversation so far from D
    assert min(res.pulled_tokens) >= 512 and max(res.pulled_tokens) >= 512 + 2 * (150 + 24)
    assert res.prompt_tokens == 512 + 24 + 3 * 150 + 2 * 24
    gate_mechanism(res, BLOCK, KV_BYTES_PER_TOKEN)
    # D answered both rounds of every turn in full, streamed: a TPOT for each, gated
    assert len(res.off_tpot_s) == len(res.on_tpot_s) == 3 * 3
    assert all(t > 0 for t in res.off_tpot_s + res.on_tpot_s)
    assert "9 ON and 9 OFF turns" in gate_tpot("512", res.off_tpot_s, res.on_tpot_s, 1000.0)
