"""The engine's Hugging Face tokenizer reads the tiny tokenizer's files exactly as
transformers' ``AutoTokenizer`` does: the same ids, the same decoded text, the same
rendered chat template. The engine serves ``--tokenizer`` without transformers
(docs/engine.md); this is the agreement of the two implementations, kept out of the unit
tier because importing transformers costs seconds (suites/unit/test_hf_tokenizer.py has
the tokenizer's own properties)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bidir_kv.engine.hf_tokenizer import HFTokenizer
from bidir_kv.testing.tokenizer import build_tiny_tokenizer_apart
from bidir_kv.testing.tokenizer_text import id_lists, messages, texts


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: Path) -> HFTokenizer:
    return HFTokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def auto(tiny_tokenizer_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


@given(text=texts)
def test_ids_equal_transformers(tok: HFTokenizer, auto: Any, text: str) -> None:
    for special in (True, False):
        assert tok.encode(text, add_special_tokens=special) == auto.encode(
            text, add_special_tokens=special
        )


@given(ids=id_lists)
def test_decode_equals_transformers(tok: HFTokenizer, auto: Any, ids: list[int]) -> None:
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == auto.decode(
            ids, skip_special_tokens=skip
        )


@given(msgs=messages, gen=st.booleans())
def test_chat_template_equals_transformers(
    tok: HFTokenizer, auto: Any, msgs: list[dict[str, str]], gen: bool
) -> None:
    ours = tok.render_chat(msgs, add_generation_prompt=gen)
    assert ours == auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert tok.encode(ours, add_special_tokens=False) == auto.encode(ours, add_special_tokens=False)


def test_the_tokenizer_builds_without_torch_or_transformers(
    tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """``make tokenizer`` (``fixtures/tiny_model.py --tokenizer-only``) imports neither
    torch nor transformers, and writes the files the fixture builds in-process."""
    apart = build_tiny_tokenizer_apart(tmp_path / "apart")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (apart / name).read_bytes() == (tiny_tokenizer_dir / name).read_bytes(), name
