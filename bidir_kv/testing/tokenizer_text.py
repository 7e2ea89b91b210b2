"""Hypothesis strategies for text, token ids and chat messages on the tiny tokenizer
(vocabulary 1024, the specials of docs/vllm-cpu.md §4.1): pseudo-words of its training
corpus, special-token strings, whitespace runs and arbitrary Unicode (multi-byte
characters included). A leaf module: only the test modules that draw from it import
hypothesis through it."""

from __future__ import annotations

from hypothesis import strategies as st

__all__ = ["SPECIALS", "id_lists", "messages", "texts"]

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
_pieces = st.one_of(
    st.text(max_size=12),
    st.sampled_from([*SPECIALS, " kalo", "mine", " ", "  ", "\n", ".", "中", "😀", "é"]),
)
texts = st.lists(_pieces, max_size=12).map("".join)
id_lists = st.lists(st.integers(0, 1023), max_size=40)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": texts}
    ),
    min_size=1,
    max_size=4,
)
