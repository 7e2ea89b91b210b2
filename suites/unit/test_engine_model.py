"""In-process pieces of the emulated engine: tokenizer, KV contents, block manager, faults,
the `KV Transfer metrics` line."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bidir_kv.engine import model
from bidir_kv.engine.faults import FaultError, Faults
from bidir_kv.engine.kvcache import BlockManager, NoFreeBlocks
from bidir_kv.engine.metrics import TransferWindow
from bidir_kv.engine.model import (
    BOS,
    EOS,
    IM_END,
    IM_START,
    WORD_BASE,
    WORDS,
    KVContent,
    Tokenizer,
    next_token,
    render_chat,
)
from bidir_kv.engine.transport.base import KVPool
from bidir_kv.policy import block_hashes


def test_generated_words_round_trip_through_text_and_template() -> None:
    tok = Tokenizer()
    rng = random.Random(0)
    gen = [WORD_BASE + rng.randrange(len(WORDS)) for _ in range(200)]
    text = tok.decode(gen)
    ids = tok.encode(render_chat([{"role": "assistant", "content": text}]), False)
    assert ids[0] == IM_START and IM_END in ids
    start = ids.index(15) + 1  # after "assistant\n" ("\n" is byte 10 -> id 15)
    assert ids[start : start + len(gen)] == gen


def test_specials_and_bytes() -> None:
    tok = Tokenizer()
    ids = tok.encode("Hé<|eos|>", add_special_tokens=True)
    assert ids[0] == BOS and ids[-1] == EOS
    assert tok.decode(ids) == "Hé"
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>Hé<|eos|>"
    with pytest.raises(ValueError, match="token ids must be ints"):
        tok.check_ids([1, 2048])


def test_kv_content_is_a_function_of_the_prefix_and_incremental() -> None:
    kv = KVContent(num_layers=2, bytes_per_layer_slot=32)
    rng = random.Random(1)
    toks = [rng.randrange(1024) for _ in range(1000)]
    whole = kv.prefix_hashes(toks, 0)
    head = kv.prefix_hashes(toks[:317], 0)
    tail = kv.prefix_hashes(toks[317:], int(head[-1]))
    assert np.array_equal(whole, np.concatenate([head, tail]))
    other = kv.prefix_hashes([*toks[:10], toks[10] ^ 1, *toks[11:]], 0)
    assert np.array_equal(whole[:10], other[:10]) and not np.any(whole[10:] == other[10:])
    slots = kv.slots(whole[:5])
    assert slots.shape == (5, 2, 32)
    assert not np.array_equal(slots[:, 0], slots[:, 1])  # layers differ


def test_next_token_depends_on_digest_and_respects_eos() -> None:
    picks = {next_token(bytes([i]) * 16, 7, allow_eos=False) for i in range(64)}
    assert len(picks) > 50 and all(p >= WORD_BASE for p in picks)
    eos = [next_token(i.to_bytes(16, "little"), 7, allow_eos=True) for i in range(5000)]
    assert 0 < eos.count(EOS) < 200


def make_bm(blocks: int = 9, prefix: bool = True) -> BlockManager:
    return BlockManager(KVPool.allocate(blocks, 4 * 2 * 8), 4, 2, prefix)


def test_block_zero_is_reserved_and_ids_ascend() -> None:
    bm = make_bm()
    assert bm.num_usable_blocks == 8
    got = bm.allocate(3)
    assert got == [1, 2, 3]
    bm.free(got)
    assert bm.allocate(3) == [1, 2, 3]


def test_prefix_cache_hits_until_evicted() -> None:
    bm = make_bm()
    hashes = block_hashes(list(range(12)), 4)
    blocks = bm.allocate(3)
    for b, h in zip(blocks, hashes, strict=True):
        bm.cache(b, h)
    bm.free(blocks)
    assert bm.lookup(hashes) == blocks  # freed but still cached
    bm.touch(blocks[:2])
    assert bm.num_free == 6
    bm.allocate(6)  # evicts the only evictable cached block (blocks[2])
    assert bm.lookup(hashes) == blocks[:2]
    with pytest.raises(NoFreeBlocks):
        bm.allocate(1)
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free([blocks[2]])
        bm.free([blocks[2]])


def test_no_prefix_caching_never_hits() -> None:
    bm = make_bm(prefix=False)
    h = block_hashes([1, 2, 3, 4], 4)
    b = bm.allocate(1)
    bm.cache(b[0], h[0])
    assert bm.lookup(h) == []


def test_write_and_read_slots_across_partial_blocks() -> None:
    bm = make_bm()
    blocks = bm.allocate(3)
    content = np.arange(11 * 2 * 8, dtype=np.uint8).reshape(11, 2, 8)
    bm.write_slots(blocks, 1, content)  # positions 1..11, starts and ends mid-block
    assert np.array_equal(bm.read_slots(blocks[0], 1, 3), content[:3])
    assert np.array_equal(bm.read_slots(blocks[1], 0, 4), content[3:7])
    assert np.array_equal(bm.read_slots(blocks[2], 0, 4), content[7:11])
    assert (
        bm.block_bytes(blocks[2], 2) == np.ascontiguousarray(bm.view[blocks[2], :, :2, :]).tobytes()
    )


def test_faults_validate_and_update_partially() -> None:
    f = Faults()
    f.update({"fail_transfers": 0.5, "stall": True})
    assert f.fail_transfers == 0.5 and f.stall
    for bad, needle in [
        ({"fail_transfers": 1.5}, "fraction"),
        ({"nope": 1}, "unknown fault"),
        ({"stall": 1}, "boolean"),
        ({"exit_on_request": 1.5}, "integer"),
    ]:
        with pytest.raises(FaultError, match=needle):
            f.update(bad)
    assert f.fail_transfers == 0.5  # a rejected update changes nothing
    assert Faults(fail_transfers=1.0).roll(1.0) and not Faults().roll(0.0)


def test_kv_transfer_metrics_line_zero_without_transfers() -> None:
    w = TransferWindow(failed=2)
    line = w.log_line()
    assert line.startswith("KV Transfer metrics: Num successful transfers=0, Avg xfer time (ms)=0")
    assert "Num failed transfers=2, Num KV expired reqs=0, Num notifs after expiry=0" in line
    w2 = TransferWindow(
        xfer=[0.002, 0.004], post=[0.001, 0.001], nbytes=[2**20, 2**20], descs=[4, 4]
    )
    line2 = w2.log_line()
    assert "Avg xfer time (ms)=3.000" in line2 and "P90 xfer time (ms)=4.000" in line2
    assert "Avg MB per transfer=1.000" in line2 and "Throughput (MB/s)=333.333" in line2


def test_guard_verifies_chain_prefix_and_partial_tail() -> None:
    from bidir_kv.engine.guard import verified_tokens
    from bidir_kv.wire.params import HeldTokens

    bs = 4
    owner_tokens = list(range(100, 114))  # 3 full blocks + 2 tail tokens
    owner = HeldTokens.of(owner_tokens, bs, block_hashes(owner_tokens, bs))
    assert owner == HeldTokens.of(owner_tokens, bs)  # the chain given or computed
    assert HeldTokens.from_wire(owner.to_wire()) == owner

    def check(prompt: list[int]) -> int:
        return verified_tokens(prompt, block_hashes(prompt, bs), owner, bs)

    assert check([*owner_tokens, 1, 2, 3]) == 14  # exact continuation: everything
    assert check(owner_tokens[:10]) == 8  # shorter prompt: whole blocks only
    edited = [*owner_tokens[:9], 0, *owner_tokens[10:], 7]
    assert check(edited) == 8  # the edit is in block 2
    assert check([*owner_tokens[:12], 0, 0, 5]) == 12  # tail differs
    assert check([0, *owner_tokens]) == 0
    # a claim answer without tokens proves nothing: the guarded reader reads nothing
    assert verified_tokens(owner_tokens, block_hashes(owner_tokens, bs), None, bs) == 0
    with pytest.raises(ValueError, match="malformed"):
        HeldTokens.from_wire({**owner.to_wire(), "chain": ["zz"]})


def test_notifications_round_trip_in_vllms_format() -> None:
    from bidir_kv.engine import notifications as nt

    assert nt.read_done("cmpl-d-1") == "cmpl-d-1:1"
    assert nt.parse(nt.read_done("cmpl-d-1")) == nt.ReadDone("cmpl-d-1", 1)
    assert nt.parse("a:b:3") == nt.ReadDone("a:b", 3)  # ids may contain ':'
    assert nt.parse("x:0") == nt.ReadDone("x", 1)  # a count below 1 counts as 1
    assert nt.heartbeat(["a", "b"]) == "HB:a,b"
    assert nt.parse(nt.heartbeat(["a", "b"])) == nt.Heartbeat(("a", "b"))
    assert nt.parse("HB:,a,,") == nt.Heartbeat(("a",))
    for bad in ("no-separator", "x:one"):
        with pytest.raises(nt.MalformedNotification):
            nt.parse(bad)


def test_engine_flags_take_their_defaults_from_engine_settings() -> None:
    from dataclasses import MISSING, fields

    from bidir_kv.engine.cli import build_parser
    from bidir_kv.engine.settings import EngineSettings

    ns = build_parser().parse_args(["tiny"])
    flag_of = {"metrics_log_interval": "kv_metrics_log_interval"}
    for f in fields(EngineSettings):
        if f.default is MISSING or f.name in ("side_host", "side_port", "kv_guard"):
            continue  # required, read from the environment, or a choice below
        assert getattr(ns, flag_of.get(f.name, f.name)) == f.default, f.name
    assert ns.kv_guard == ("hashes" if EngineSettings.default("kv_guard") else "off")
    with pytest.raises(KeyError):
        EngineSettings.default("model")


def test_budget_below_max_model_len_without_chunked_prefill_is_refused(capsys) -> None:
    """As vLLM's SchedulerConfig: no chunking and a budget below max_model_len is an
    error naming both; an unset budget is raised to max_model_len instead."""
    from bidir_kv.engine.cli import _settings, build_parser

    parser = build_parser()
    bad = parser.parse_args(
        ["tiny", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "256"]
    )
    with pytest.raises(SystemExit) as exc:
        _settings(parser, bad)
    assert exc.value.code == 2
    assert "max_num_batched_tokens (256) is smaller than max_model_len" in capsys.readouterr().err
    unset = _settings(parser, parser.parse_args(["tiny", "--no-enable-chunked-prefill"]))
    assert unset.effective_max_num_batched_tokens == unset.max_model_len
    chunked = _settings(parser, parser.parse_args(["tiny"]))
    assert chunked.effective_max_num_batched_tokens == chunked.profile.max_num_batched_tokens


def test_memoized_encoding_matches_a_fresh_one() -> None:
    """The piece and text memos never change ids: a text with pieces seen and unseen
    (the fallback path), then the same text again (the text memo)."""
    rng = random.Random(4)
    parts = ["kalo", "su", "é", "<|im_end|>", "  ", "x!", "mi" * 40]
    text = " ".join("".join(rng.choice(parts) for _ in range(3)) for _ in range(400))
    model._PIECE_IDS.clear()
    model._RECENT_TEXTS.clear()
    fresh = Tokenizer().encode(text)
    model._RECENT_TEXTS.clear()
    Tokenizer().encode(text[: len(text) // 2])  # half the pieces become known
    model._RECENT_TEXTS.clear()
    assert Tokenizer().encode(text) == fresh
    assert Tokenizer().encode(text) == fresh  # from the text memo
    assert Tokenizer().encode(text, add_special_tokens=False) == fresh[1:]


def test_next_turn_encoded_from_the_previous_head_matches_a_fresh_encoding() -> None:
    rng = random.Random(6)
    words = [" " + w for w in WORDS[:50]] + [" suri", "é", "<|im", "|>", "  "]
    msgs: list[dict[str, str]] = []
    texts = []
    for turn in range(5):
        content = "x" + "".join(rng.choice(words) for _ in range(60))  # "x" joins the header
        msgs.append({"role": "user" if turn % 2 == 0 else "assistant", "content": content})
        texts.append(render_chat(msgs))
    texts.append(texts[-1] + " " + WORDS[0])  # ends inside a word ...
    texts.append(texts[-1] + WORDS[1])  # ... that the next text continues
    texts.append(texts[-1][:40] + "x" + texts[-1][41:])  # differs inside the remembered head
    model._RECENT_TEXTS.clear()
    incremental = [Tokenizer().encode(t, special) for t in texts for special in (False, True)]
    fresh = []
    for t in texts:
        for special in (False, True):
            model._RECENT_TEXTS.clear()
            fresh.append(Tokenizer().encode(t, special))
    assert incremental == fresh
