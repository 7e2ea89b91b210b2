"""The engine's fast JSON encoding writes the values ``json.dumps`` writes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bidir_kv.engine.jsonenc import dumps, json_response


@pytest.mark.parametrize(
    "obj",
    [
        {"count": 3, "max_model_len": 4096, "tokens": [1, 2, 3], "token_strs": None},
        {"choices": [{"text": "héllo ✓", "logprobs": -0.25, "token_ids": [7]}], "x": True},
        {"big": 2**70, "tokens": list(range(5))},  # beyond orjson's 64 bits: fallback
        {"s": "a\ud800b"},  # a lone surrogate: fallback, escaped as json.dumps does
        {1: "int key", "t": (1, 2)},
    ],
)
def test_dumps_values_equal_stdlib(obj: Any) -> None:
    out = dumps(obj)
    assert isinstance(out, bytes)
    assert json.loads(out) == json.loads(json.dumps(obj))
    assert b", " not in out and b": " not in out  # compact, as vLLM's bodies


def test_json_response_headers() -> None:
    resp = json_response({"a": 1}, status=410)
    assert resp.status == 410
    assert resp.content_type == "application/json"
    assert resp.charset == "utf-8"
    assert resp.body == b'{"a":1}'
