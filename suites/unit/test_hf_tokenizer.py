"""The engine's Hugging Face tokenizer (bidir_kv/engine/hf_tokenizer.py) on the tiny
tokenizer (the ``tiny_tokenizer_dir`` fixture): round trips, specials, the chat template,
streaming detokenization, bad input. That it reads the files exactly as transformers
does is the integration tier's (suites/integration/test_hf_tokenizer_transformers.py:
importing transformers costs seconds, and what is checked there is the agreement of
two implementations, not ours alone).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bidir_kv.engine.hf_tokenizer import HFTokenizer, IncrementalDetokenizer, TokenizerLoadError
from bidir_kv.engine.model import ChatTemplateError
from bidir_kv.testing.tokenizer_text import SPECIALS, id_lists, texts


@pytest.fixture(scope="session")
def tok_dir(tiny_tokenizer_dir: Path) -> Path:
    return tiny_tokenizer_dir


@pytest.fixture(scope="session")
def tok(tok_dir: Path) -> HFTokenizer:
    return HFTokenizer(tok_dir)


def test_built_files_and_config(tok_dir: Path) -> None:
    assert {p.name for p in tok_dir.iterdir()} == {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    specials = (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"])
    assert specials == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert cfg["model_max_length"] == 4096
    assert "<|im_start|>" in cfg["chat_template"]


def test_special_tokens(tok: HFTokenizer) -> None:
    assert tok.vocab_size == 1024
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert tok.model_max_length == 4096
    assert tok.encode("".join(SPECIALS), add_special_tokens=False) == [0, 1, 2, 3, 4]
    ids = tok.encode("hi")
    assert ids[0] == 1 and tok.encode("hi", add_special_tokens=False) == ids[1:]
    assert tok.decode([3, *ids, 4, 2]) == "hi"
    assert tok.decode([3, *ids, 4]) == "hi"
    assert tok.decode([3, *ids, 4], skip_special_tokens=False) == "<|im_start|><|bos|>hi<|im_end|>"
    assert tok.token_strs([1, *ids[1:]])[0] == "<|bos|>"


@given(text=texts)
def test_text_round_trips(tok: HFTokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.check_ids(ids) == ids


@given(data=st.data())
def test_word_ids_concatenate_to_text_that_re_encodes_exactly(
    tok: HFTokenizer, data: st.DataObject
) -> None:
    words = tok.word_ids()
    assert len(words) > 400 and {tok.bos_token_id, tok.eos_token_id}.isdisjoint(words)
    ids = data.draw(st.lists(st.sampled_from(words), min_size=1, max_size=80))
    text = tok.decode(ids)
    assert tok.encode(text, add_special_tokens=False) == ids
    prompt = tok.encode(tok.render_chat([{"role": "assistant", "content": text}], False))
    assert ids == prompt[-len(ids) - 2 : -2]  # before "<|im_end|>\n"


def test_chat_template_shape(tok: HFTokenizer) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.render_chat(msgs) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    joined = "<|im_start|>user\na\nb<|im_end|>\n"  # text parts joined by newlines, as vLLM
    assert tok.render_chat(parts, add_generation_prompt=False) == joined
    none = [{"role": "assistant", "content": None}]
    assert tok.render_chat(none, False) == "<|im_start|>assistant\n<|im_end|>\n"


@pytest.mark.parametrize(
    ("msgs", "needle"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        ([{"content": "x"}], "messages[0]"),
        ([{"role": "user", "content": "x"}, "y"], "messages[1]"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
    ],
)
def test_bad_messages_raise_chat_template_error(tok: HFTokenizer, msgs: Any, needle: str) -> None:
    with pytest.raises(ChatTemplateError, match=re.escape(needle)):
        tok.render_chat(msgs)


def _copy_with_config(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_template_variables_and_errors(tok_dir: Path, tmp_path: Path) -> None:
    tpl = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}"
        "{{ raise_exception('no bad roles') }}{% endif %}{{ m.content | tojson }}{% endfor %}"
        "{% if add_generation_prompt %}{{ greeting | default('>') }}{% endif %}"
        "{% generation %}{{ eos_token }}{% endgeneration %}"
    )
    t = HFTokenizer(_copy_with_config(tok_dir, tmp_path / "t", chat_template=tpl))
    msgs = [{"role": "user", "content": 'é"<'}]
    assert t.render_chat(msgs) == '<|bos|>"é\\"<">' + "<|eos|>"
    assert t.render_chat(msgs, greeting="!") == '<|bos|>"é\\"<"!<|eos|>'
    with pytest.raises(ChatTemplateError, match="no bad roles"):
        t.render_chat([{"role": "bad", "content": ""}])


def test_template_sources(tok_dir: Path, tmp_path: Path) -> None:
    none = HFTokenizer(_copy_with_config(tok_dir, tmp_path / "none", chat_template=None))
    assert none.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        none.render_chat([{"role": "user", "content": "x"}])
    jinja_dir = _copy_with_config(tok_dir, tmp_path / "jinja", chat_template=None)
    (jinja_dir / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    assert HFTokenizer(jinja_dir).render_chat([{"role": "user", "content": "x"}]) == "x!"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    named_dir = _copy_with_config(tok_dir, tmp_path / "named", chat_template=named)
    assert HFTokenizer(named_dir).render_chat([{"role": "user", "content": "x"}]) == "D"
    broken = _copy_with_config(tok_dir, tmp_path / "broken", chat_template="{% for %}")
    with pytest.raises(TokenizerLoadError, match="chat template"):
        HFTokenizer(broken)


def test_load_errors_name_the_path(tok_dir: Path, tmp_path: Path) -> None:
    hub_name = r"'Qwen/Qwen3-0\.6B'.*/Qwen/Qwen3-0\.6B is not a local directory"
    with pytest.raises(TokenizerLoadError, match=hub_name):
        HFTokenizer("Qwen/Qwen3-0.6B")
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = re.escape(f"{empty}/tokenizer.json does not exist")
    with pytest.raises(TokenizerLoadError, match=missing):
        HFTokenizer(empty)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerLoadError, match="cannot load"):
        HFTokenizer(bad)
    bare = tmp_path / "bare"  # no tokenizer_config.json: loads, without specials or template
    bare.mkdir()
    shutil.copy(tok_dir / "tokenizer.json", bare)
    t = HFTokenizer(bare)
    assert t.eos_token_id is None and t.chat_template is None and t.vocab_size == 1024


def test_bad_ids(tok: HFTokenizer) -> None:
    for bad in ([1024], [-1], [True], ["5"], [1.0]):
        with pytest.raises(ValueError, match="prompt token 0"):
            tok.check_ids(bad)
    with pytest.raises(ValueError, match="prompt token 1 is 5000"):
        tok.decode([5, 5000])


def _stream(tok: HFTokenizer, ids: list[int], skip: bool) -> list[str]:
    d = tok.detokenizer(skip_special_tokens=skip)
    pieces = [d.push(t) for t in ids]
    pieces.append(d.flush())
    assert d.text == "".join(pieces)
    return pieces


@given(ids=id_lists, skip=st.booleans())
def test_streaming_equals_full_decode(tok: HFTokenizer, ids: list[int], skip: bool) -> None:
    assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


@given(text=texts)
def test_streaming_text_never_splits_a_character(tok: HFTokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces = _stream(tok, ids, True)
    assert "".join(pieces) == tok.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)


def test_streaming_holds_back_split_characters(tok: HFTokenizer) -> None:
    ids = tok.encode("中😀", add_special_tokens=False)
    assert len(ids) > 2 and "\ufffd" in tok.decode(ids[:1])  # bytes split across tokens
    pieces = _stream(tok, ids, True)
    assert [p for p in pieces if p] == ["中", "😀"]
    cut = _stream(tok, ids[:-1], True)  # ends inside 😀: flush releases U+FFFD
    assert "".join(cut) == tok.decode(ids[:-1]) and cut[-1].endswith("\ufffd")


def test_context_primes_without_emitting(tok: HFTokenizer) -> None:
    prompt = tok.encode("<|im_start|>assistant\n")
    out = tok.encode(" kalo mine 中", add_special_tokens=False)
    d = tok.detokenizer(context=prompt)
    assert "".join(d.push(t) for t in out) + d.flush() == " kalo mine 中"


def test_generic_over_any_decode() -> None:
    """Works with any ``decode(ids, skip)`` (e.g. the emulator's tokenizer)."""
    from bidir_kv.engine.model import Tokenizer

    emu = Tokenizer()
    ids = emu.encode("a é 中 kalo", add_special_tokens=False)
    d = IncrementalDetokenizer(emu.decode)
    assert "".join(d.push(t) for t in ids) + d.flush() == "a é 中 kalo"


@pytest.fixture(scope="session")
def metaspace(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    """A SentencePiece-style tokenizer (``▁`` for spaces, stripped at the start of a decode):
    single-token decodes lose spaces there, the window must not."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"], show_progress=False)
    t.train_from_iterator(["hello world kalo mine"] * 50 + ["the quick brown fox"] * 50, trainer)
    spec = json.loads(t.to_str())  # byte tokens <0x00>..<0xFF> as ordinary vocabulary
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    t = Tokenizer.from_str(json.dumps(spec))
    out = tmp_path_factory.mktemp("metaspace")
    t.save(str(out / "tokenizer.json"))
    return HFTokenizer(out)


@given(text=st.text(alphabet="helo wrdkamin中é", max_size=30))
def test_streaming_sentencepiece_style(metaspace: HFTokenizer, text: str) -> None:
    ids = metaspace.encode(text)
    d = metaspace.detokenizer()
    assert "".join(d.push(t) for t in ids) + d.flush() == metaspace.decode(ids)
