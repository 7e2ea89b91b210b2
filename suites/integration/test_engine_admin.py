"""The emulator's admin endpoints (``/_emulator/faults``, ``/_emulator/state``) are off
unless the engine was started with ``--enable-admin`` or ``--admin-token``; a claim
body with a bad field is a 400 naming it. The turn itself (P, then D, D's claim on P)
does not need them."""

from __future__ import annotations

import random
from collections.abc import Callable

from bidir_kv.client import NodeClient
from bidir_kv.testing.engines import EnginePair, random_prompt

Factory = Callable[..., EnginePair]


def test_admin_endpoints_are_off_by_default_and_token_gated(engine_pair: Factory) -> None:
    pair = engine_pair(
        prefill={"admin": False}, decode={"admin": False, "extra_args": ("--admin-token", "s3cret")}
    )
    with NodeClient(pair.p.url, timeout=10) as p:
        for method, path in (
            ("GET", "/_emulator/faults"),
            ("GET", "/_emulator/state"),
            ("POST", "/_emulator/faults"),
        ):
            reply = p.request(method, path, json={"stall": True} if method == "POST" else None)
            assert reply.status == 403, (path, reply.text)
            assert "--enable-admin" in reply.json()["error"]["message"]
    with NodeClient(pair.d.url, timeout=10) as d:
        assert d.get("/_emulator/state").status == 401
        wrong = d.request("GET", "/_emulator/state", headers={"Authorization": "Bearer no"})
        assert wrong.status == 401 and "--admin-token" in wrong.text
        ok = d.request("GET", "/_emulator/state", headers={"Authorization": "Bearer s3cret"})
        assert ok.status == 200 and "running" in ok.json_object()
    # the stall was never set: a whole turn still runs, D claiming P's blocks
    pr, dr = pair.turn(random_prompt(random.Random("admin"), 64), 4)
    assert pr.ok and dr is not None and dr.ok, (pr.error, dr and dr.error)


def test_claim_body_is_validated_naming_the_field(engine_pair: Factory) -> None:
    pair = engine_pair()
    with NodeClient(pair.p.url, timeout=10) as p:
        for body, field in (
            ({"request_id": "r", "blocks": ["x", 1]}, "'blocks'"),
            ({"request_id": "r", "blocks": [True]}, "'blocks'"),
            ({"request_id": 5, "blocks": [1]}, "'request_id'"),
            ([1, 2], "JSON object"),
        ):
            reply = p.request("POST", "/_emulator/claim", json=body)
            assert reply.status == 400, (body, reply.status, reply.text)
            assert field in reply.json()["error"]["message"], reply.text
