"""The emulated model's sampling digest sees every KV byte, however the slots were filled;
the chain memo reuses earlier turns' block hashes without changing one.

Why: a wrong pull (KV of other tokens or positions) must change the output. The digest
streams one fingerprint per block (``model.fingerprints``) instead of hashing every byte,
so these tests pin what that must keep: one changed byte anywhere changes the token, and
the result does not depend on the path (one prefill, chunks, decode steps, a pull).
"""

from __future__ import annotations

import random

import numpy as np

from bidir_kv.engine.chains import ChainMemo
from bidir_kv.engine.compute import ModelRunner
from bidir_kv.engine.kvcache import BlockManager
from bidir_kv.engine.model import KVContent, fingerprints
from bidir_kv.engine.request import Request
from bidir_kv.engine.transport.base import KVPool
from bidir_kv.policy import ROOT_HASH, block_hashes

BS, LAYERS, SLOT_BYTES = 4, 2, 16


def _runner(blocks: int = 40) -> ModelRunner:
    pool = KVPool.allocate(blocks, BS * LAYERS * SLOT_BYTES)
    return ModelRunner(BlockManager(pool, BS, LAYERS, enable_prefix_caching=False))


def _request(tokens: list[int], blocks: list[int]) -> Request:
    req = Request("r", list(tokens), 1)
    req.tokens, req.blocks = list(tokens), list(blocks)
    return req


def test_fingerprint_changes_with_any_byte_and_row_order() -> None:
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, size=(6, 37), dtype=np.uint8)  # not a multiple of 8
    base = fingerprints(rows)
    for r, c in [(0, 0), (2, 17), (5, 36), (3, 8)]:
        bad = rows.copy()
        bad[r, c] ^= 1 << (c % 8)
        changed = fingerprints(bad) != base
        assert changed[r] and changed.sum() == 1
    assert not np.array_equal(fingerprints(rows[[1, 0, 2, 3, 4, 5]]), base)


def test_sample_is_the_same_through_chunks_decode_and_a_copied_pull() -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(5, 1024) for _ in range(37)]  # 9 full blocks and a tail
    whole = _runner()
    a = _request(tokens, list(range(1, 11)))
    whole.compute(a, 0, len(tokens))
    chunked = _runner()
    b = _request(tokens, list(range(30, 20, -1)))  # other block ids, reversed
    for start in range(0, len(tokens), 5):
        chunked.compute(b, start, min(len(tokens), start + 5))
        chunked.sample(b)  # partial digests on the way must not leak into the result
    assert whole.sample(a) == chunked.sample(b)
    # a "pull": the same bytes copied into a third engine's blocks
    pulled = _runner()
    c = _request(tokens, list(range(11, 21)))
    pulled.blocks.pool.data[c.blocks] = whole.blocks.pool.data[a.blocks]
    c.num_computed = len(tokens)
    assert pulled.sample(c) == whole.sample(a)


def test_one_wrong_byte_anywhere_changes_the_token() -> None:
    rng = random.Random(5)
    tokens = [rng.randrange(5, 1024) for _ in range(30)]  # 7 full blocks and a tail of 2
    ref = _runner()
    good = _request(tokens, list(range(1, 9)))
    ref.compute(good, 0, len(tokens))
    want = ref.sample(good)
    nbytes = BS * LAYERS * SLOT_BYTES
    changed = 0
    for trial in range(40):
        runner = _runner()
        req = _request(tokens, list(range(1, 9)))
        runner.blocks.pool.data[:] = ref.blocks.pool.data
        block = req.blocks[trial % 8]
        offset = (trial * 37) % nbytes
        if block == req.blocks[7]:  # the tail block: only its 2 valid slots count
            layer, slot = trial % LAYERS, trial % 2
            offset = (layer * BS + slot) * SLOT_BYTES + trial % SLOT_BYTES
        runner.blocks.pool.data[block, offset] ^= 0x10
        req.num_computed = len(tokens)
        changed += runner.sample(req) != want
    # a token is one of ~760 words: a changed digest keeps the same word ~1/760 of the time
    assert changed >= 38


def test_chain_memo_gives_exactly_block_hashes() -> None:
    rng = random.Random(9)
    memo = ChainMemo(BS, size=4)
    history = [rng.randrange(1024) for _ in range(50)]
    memo.remember(history, block_hashes(history, BS), ROOT_HASH)
    cases = [
        history + [rng.randrange(1024) for _ in range(30)],  # the next turn
        [*history[:22], 7, *history[23:]],  # differs inside block 5
        history[:13],  # shorter than what is remembered
        [history[0] ^ 1, *history[1:]],  # differs in the first token
        [rng.randrange(1024) for _ in range(40)],  # unrelated
    ]
    for tokens in cases:
        assert memo.chain(tokens, ROOT_HASH) == block_hashes(tokens, BS)
        salted = b"s" * 16
        assert memo.chain(tokens, salted) == block_hashes(tokens, BS, salted)


def test_short_runs_hash_like_long_ones() -> None:
    """Decode steps hash one slot in plain Python; the result is the vectorised one."""
    kv = KVContent(num_layers=2, bytes_per_layer_slot=16)
    rng = random.Random(2)
    toks = [rng.randrange(1024) for _ in range(100)]
    whole = kv.prefix_hashes(toks, 12345)
    h, parts = 12345, []
    for i in range(0, 100, 3):
        part = kv.prefix_hashes(toks[i : i + 3], h)
        parts.append(part)
        h = int(part[-1])
    assert np.array_equal(np.concatenate(parts), whole)
