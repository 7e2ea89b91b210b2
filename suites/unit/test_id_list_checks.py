"""Checks of long id lists (body tree, block ids) keep their verdicts on the fast path.

Block-id lists and token-id lists are checked in one C pass when they hold exact
ints; these cases sit on the edge between that pass and the item-by-item one.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from bidir_kv.engine.transport.base import KVTransportError
from bidir_kv.engine.transport.tcp_io import check_ids
from bidir_kv.intake import InputError, decode_json
from bidir_kv.intake.body import MAX_JSON_DEPTH
from bidir_kv.protocol import KVTransferParams, ProtocolError


def _nested(depth_of_list: int, inner: list[Any]) -> bytes:
    """A body whose innermost list sits at ``depth_of_list`` (the root object is 1)."""
    value: Any = inner
    for _ in range(depth_of_list - 2):
        value = [value]
    return json.dumps({"a": value}).encode()


@pytest.mark.parametrize(
    ("depth", "inner", "ok"),
    [
        (MAX_JSON_DEPTH - 1, [1, 2, 3], True),  # the ints are at the limit
        (MAX_JSON_DEPTH, [1, 2, 3], False),  # the ints are one level too deep
        (MAX_JSON_DEPTH, [], True),  # an empty list at the limit holds nothing deeper
        (MAX_JSON_DEPTH - 1, [1, None, 2.5, True, "s"], True),
    ],
)
def test_depth_limit_counts_the_leaves_of_a_list(depth: int, inner: list[Any], ok: bool) -> None:
    raw = _nested(depth, inner)
    if ok:
        assert decode_json(raw)["a"]
    else:
        with pytest.raises(InputError, match="nests deeper"):
            decode_json(raw)


def test_lone_surrogate_in_a_list_of_strings_is_refused() -> None:
    with pytest.raises(InputError, match="surrogate"):
        decode_json(b'{"stop": ["ok", "a\\ud800b"], "ids": [1, 2, 3]}')


@pytest.mark.parametrize(
    ("ids", "ok"),
    [
        ([[0, 1, 2], []], True),
        ([list(range(1500))], True),
        ([[0, True]], False),  # a bool is not a block id
        ([[0, -1]], False),
        ([[0, 1.0]], False),
        ([[0, "1"]], False),
    ],
)
def test_remote_block_ids_verdicts(ids: list[list[Any]], ok: bool) -> None:
    wire = {"do_remote_decode": False, "do_remote_prefill": True, "remote_block_ids": ids}
    if ok:
        assert KVTransferParams.parse(wire).to_dict()["remote_block_ids"] == ids
    else:
        with pytest.raises(ProtocolError, match="remote_block_ids"):
            KVTransferParams.parse(wire)


@pytest.mark.parametrize(
    ("ids", "expect"),
    [
        ([3, 4, 5], [3, 4, 5]),
        ((0, 9), [0, 9]),
        ([np.int64(2), 3], [2, 3]),  # numpy ints take the item-by-item path
        ([], []),
    ],
)
def test_check_ids_accepts(ids: Any, expect: list[int]) -> None:
    out = check_ids(ids, 10, "local")
    assert out == expect
    assert all(type(b) is int for b in out)


@pytest.mark.parametrize(
    ("ids", "needle"),
    [
        ([1, True], "not an integer"),
        ([1, -1], "out of range"),
        ([1, 10], "out of range"),
        ([1.0], "not an integer"),
    ],
)
def test_check_ids_refuses(ids: list[Any], needle: str) -> None:
    with pytest.raises(KVTransportError, match=needle):
        check_ids(ids, 10, "local")
