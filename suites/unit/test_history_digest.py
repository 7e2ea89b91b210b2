"""History identity: the canonical form, the digest and its scope (bidir_kv.router.history),
and the reply the relay assembles from D's stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bidir_kv.router.history import history_of, opt_out
from bidir_kv.router.identity import IdentityError, tenant_digest
from bidir_kv.router.relay import StreamRelay
from bidir_kv.router.reply import assemble_reply

pytestmark = pytest.mark.unit

ALICE, MALLORY = tenant_digest("Bearer alice"), tenant_digest("Bearer mallory")
USER = {"role": "user", "content": "Tell me about dragons."}
REPLY = {"role": "assistant", "content": "Dragons breathe fire."}
NEXT = {"role": "user", "content": "And castles?"}


def body(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": list(messages), **fields}


def stored(first: dict[str, Any], tenant: str = ALICE, reply: dict[str, Any] = REPLY) -> str:
    """The storage key turn 1 leaves behind."""
    return history_of(first, tenant).key_after(reply).storage_key


def looked_up(second: dict[str, Any], tenant: str = ALICE) -> str | None:
    key = history_of(second, tenant).lookup
    return None if key is None else key.storage_key


def test_next_turn_finds_the_entry_its_previous_turn_left() -> None:
    assert looked_up(body(USER)) is None  # first turn: nothing to look up
    assert looked_up(body(USER, REPLY, NEXT)) == stored(body(USER))
    # turn 3 finds turn 2's entry, not turn 1's
    reply2 = {"role": "assistant", "content": "Castles are tall."}
    third = body(USER, REPLY, NEXT, reply2, {"role": "user", "content": "more"})
    assert looked_up(third) == stored(body(USER, REPLY, NEXT), reply=reply2)
    assert looked_up(third) != stored(body(USER))


def test_two_tenants_with_the_same_history_never_share_a_key() -> None:
    second = body(USER, REPLY, NEXT)
    assert looked_up(second, MALLORY) != stored(body(USER), ALICE)
    assert looked_up(second, MALLORY) == stored(body(USER), MALLORY)


# Every request field of vLLM's chat API that changes the tokens a template renders from
# the same messages, with a value to set (written out here, not read from SCOPE_FIELDS: a
# field dropped from the scope must fail this test).
PROMPT_CHANGING = (
    ("model", "other"),
    ("cache_salt", "s"),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "required"),
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("parallel_tool_calls", False),
    ("chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}"),
    ("chat_template_kwargs", {"enable_thinking": False}),
    ("add_generation_prompt", False),
    ("continue_final_message", True),
    ("add_special_tokens", True),
    ("documents", [{"title": "t", "text": "x"}]),
    ("reasoning_effort", "high"),
    ("include_reasoning", False),
    ("thinking_token_budget", 128),
    ("mm_processor_kwargs", {"num_crops": 4}),
    ("media_io_kwargs", {"video": {"num_frames": 8}}),
)


@pytest.mark.parametrize(("field", "value"), PROMPT_CHANGING, ids=[f for f, _ in PROMPT_CHANGING])
def test_a_prompt_changing_field_is_in_the_scope(field: str, value: Any) -> None:
    """Two requests that differ only in ``field`` never share a key: set on one turn
    only, or set to another value on each; the same value on both turns still finds."""
    first, second = body(USER), body(USER, REPLY, NEXT)
    assert looked_up({**second, field: value}) != stored(first)
    assert looked_up(second) != stored({**first, field: value})
    assert looked_up({**second, field: value}) != stored({**first, field: [value]})
    assert looked_up({**second, field: value}) == stored({**first, field: value})


def test_sampling_fields_are_not_in_the_scope() -> None:
    first, second = body(USER), body(USER, REPLY, NEXT)
    for field, value in (
        ("temperature", 0.7),
        ("max_tokens", 99),
        ("stream", True),
        ("seed", 3),
        ("stream_options", {"include_usage": True}),
    ):
        assert looked_up({**second, field: value}) == stored(first), field


def test_reasoning_fields_are_excluded_but_stripping_reasoning_from_content_misses() -> None:
    reply = {"role": "assistant", "content": "<think>hmm</think>Dragons breathe fire."}
    sent_back = {**reply, "reasoning_content": "hmm", "reasoning": "hmm"}
    assert looked_up(body(USER, sent_back, NEXT)) == stored(body(USER), reply=reply)
    stripped = {"role": "assistant", "content": "Dragons breathe fire."}
    assert looked_up(body(USER, stripped, NEXT)) != stored(body(USER), reply=reply)


def test_tool_calls_are_in_the_digest_and_none_means_absent() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    reply = {"role": "assistant", "content": None, "tool_calls": [call]}
    tool = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    # the openai client's model_dump() adds null fields; a streamed call carries an index
    echoed = {
        "role": "assistant",
        "tool_calls": [{**call, "index": 0}],
        "refusal": None,
        "audio": None,
        "function_call": None,
        "annotations": [],
    }
    assert looked_up(body(USER, echoed, tool)) == stored(body(USER), reply=reply)
    other = {**reply, "tool_calls": [{**call, "function": {"name": "f", "arguments": "{}"}}]}
    assert looked_up(body(USER, other, tool)) != stored(body(USER), reply=reply)
    assert looked_up(body(USER, {**reply, "tool_calls": None}, tool)) != stored(
        body(USER), reply=reply
    )


def test_content_forms_are_kept_apart() -> None:
    parts = {"role": "assistant", "content": [{"type": "text", "text": REPLY["content"]}]}
    assert looked_up(body(USER, parts, NEXT)) != stored(body(USER))
    assert looked_up(body(USER, {**REPLY, "name": "bot"}, NEXT)) != stored(body(USER))


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ("hello", "messages[1] must be an object"),
        ({"content": "x"}, "messages[1].role"),
        ({"role": "user", "content": 5}, "messages[1].content"),
        ({"role": "user", "content": ["x"]}, "messages[1].content[0]"),
        ({"role": "assistant", "tool_calls": {"id": "c"}}, "messages[1].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"id": "c"}]}, "messages[1].tool_calls[0].function"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
            "messages[1].tool_calls[0].function.name",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_a_malformed_message_is_refused_naming_the_field(message: Any, field: str) -> None:
    with pytest.raises(IdentityError, match=field.replace("[", r"\[").replace("]", r"\]")):
        history_of(body(USER, message), ALICE)


def test_opt_outs() -> None:
    assert opt_out(body(USER), chat=True) is None
    assert opt_out(body(USER, n=1), chat=True) is None
    assert opt_out({"prompt": "x"}, chat=False) == "completions"
    assert opt_out(body(USER, n=2), chat=True) == "n"
    assert opt_out(body(USER, truncate_prompt_tokens=100), chat=True) == "truncate_prompt_tokens"


def _chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    return json.dumps(
        {"id": "x", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
    ).encode()


def test_reply_assembled_from_a_stream_is_what_the_client_sends_back() -> None:
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning_content": "thinking"}),
        _chunk({"content": "Dragons "}),
        _chunk({"content": "breathe fire."}),
        _chunk({}, "stop", kv_transfer_params={"remote_block_ids": [1]}),
    ]
    reply = assemble_reply(chunks)
    assert reply == {"role": "assistant", "content": "Dragons breathe fire.", "tool_calls": None}
    assert looked_up(body(USER, REPLY, NEXT)) == stored(body(USER), reply=reply)


def test_streamed_tool_calls_are_merged_by_index() -> None:
    chunks = [
        _chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": ""},
                    }
                ]
            }
        ),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
        _chunk(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "c2",
                        "type": "function",
                        "function": {"name": "g", "arguments": "{}"},
                    }
                ]
            }
        ),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        _chunk({}, "tool_calls"),
    ]
    reply = assemble_reply(chunks)
    assert reply is not None and reply["content"] is None
    assert reply["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]


def test_the_relay_keeps_payloads_only_when_asked() -> None:
    event = b"data: " + _chunk({"content": "hi"})
    quiet = StreamRelay(keep_params=False, collect_ids=False, strip_ids=False)
    quiet.process_event(event, b"\n\n")
    assert quiet.result.reply() is None
    relay = StreamRelay(keep_params=False, collect_ids=False, strip_ids=False, collect_reply=True)
    assert relay.process_event(event, b"\n\n") == event + b"\n\n"  # relayed unchanged
    relay.process_event(b"data: [DONE]", b"\n\n")
    assert relay.result.reply() == {"role": "assistant", "content": "hi", "tool_calls": None}
