"""The one exception tree (``bidir_kv.errors``) and the HTTP answers it maps to.

Every exception class bidir_kv defines derives from ``BidirKVError`` through exactly one
area (a direct subclass of the base, defined in a module named ``errors``); a bare
``class FooError(Exception)`` anywhere in the package fails here. Each server turns an
error into its answer in one function; the statuses, types and messages below are the
ones the integration suites see from the running servers.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import pkgutil
from pathlib import Path
from types import ModuleType

import pytest

import bidir_kv
from bidir_kv import errors
from bidir_kv.errors import BidirKVError

PACKAGE = Path(bidir_kv.__file__).parent
BUILTIN_EXCEPTIONS = {
    name
    for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, BaseException)
}


def _import_all() -> tuple[list[ModuleType], list[Path]]:
    """Every module of bidir_kv imported; the files of those that need a package this
    environment lacks (vLLM for the connector) are returned for an AST look instead."""
    modules, unimportable = [], []
    for info in pkgutil.walk_packages(bidir_kv.__path__, "bidir_kv."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue  # runs the CLI on import; defines no class
        try:
            modules.append(importlib.import_module(info.name))
        except ModuleNotFoundError as exc:
            if (exc.name or "").startswith("bidir_kv"):
                raise
            parts = info.name.split(".")[1:]
            path = PACKAGE.joinpath(*parts)
            unimportable.append(path / "__init__.py" if path.is_dir() else path.with_suffix(".py"))
    return modules, unimportable


def _package_exceptions() -> list[type[BaseException]]:
    out, todo, seen = [], [BaseException], set()
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
                if sub.__module__.split(".")[0] == "bidir_kv":
                    out.append(sub)
    return sorted(out, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def is_area(cls: type) -> bool:
    return BidirKVError in cls.__bases__ and cls.__module__.rsplit(".", 1)[-1] == "errors"


def tree_violations(classes: list[type[BaseException]]) -> dict[str, str]:
    """``module.Class -> what is wrong`` for each class outside the one tree."""
    bad = {}
    for cls in classes:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if cls is BidirKVError:
            continue
        if not issubclass(cls, BidirKVError):
            bad[name] = "does not derive from bidir_kv.errors.BidirKVError"
            continue
        areas = [c.__name__ for c in cls.__mro__ if is_area(c)]
        if BidirKVError in cls.__bases__ and not is_area(cls):
            bad[name] = "subclasses BidirKVError directly outside an errors module (pick an area)"
        elif len(areas) != 1:
            bad[name] = f"derives from {len(areas)} areas {areas}, not exactly one"
    return bad


def unimportable_violations(path: Path, known: set[str]) -> list[str]:
    """In a module we cannot import here: classes with a builtin exception base and no
    base among our exception classes (``known``: their names)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ClassDef):
            continue
        names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
        if names & BUILTIN_EXCEPTIONS and not names & known:
            out.append(f"{path.name}: {node.name}")
    return out


def test_every_exception_derives_from_the_base_through_one_area() -> None:
    modules, unimportable = _import_all()
    assert len(modules) > 100  # the walk saw the package
    classes = _package_exceptions()
    assert len(classes) > 30
    assert tree_violations(classes) == {}
    known = {c.__name__ for c in classes}
    assert [v for p in unimportable for v in unimportable_violations(p, known)] == []


def test_the_areas() -> None:
    areas = {c.__name__ for c in BidirKVError.__subclasses__() if c.__module__ == errors.__name__}
    assert areas == {
        "CheckFailure",
        "ConfigError",
        "EngineError",
        "IntakeError",
        "KVTransferError",
        "PlanError",
        "RouterError",
        "TopologyError",
    }
    assert set(errors.__all__) == areas | {"BidirKVError"}


def test_the_tree_check_on_planted_classes() -> None:
    def planted(name: str, *bases: type) -> type[BaseException]:
        return type(name, bases, {"__module__": "planted.router"})

    area = type("SideArea", (BidirKVError,), {"__module__": "planted.client.errors"})
    classes = [
        planted("FooError", Exception),
        planted("Bar", ValueError),
        planted("Direct", BidirKVError),
        planted("Two", errors.EngineError, errors.RouterError),
        planted("Fine", errors.RouterError, RuntimeError),
        planted("FineToo", area),
    ]
    assert tree_violations(classes) == {
        "planted.router.FooError": "does not derive from bidir_kv.errors.BidirKVError",
        "planted.router.Bar": "does not derive from bidir_kv.errors.BidirKVError",
        "planted.router.Direct": "subclasses BidirKVError directly outside an errors "
        "module (pick an area)",
        "planted.router.Two": "derives from 2 areas ['EngineError', 'RouterError'], "
        "not exactly one",
    }


def test_the_ast_check_on_a_planted_module(tmp_path: Path) -> None:
    path = tmp_path / "worker.py"
    path.write_text(
        "class A(RuntimeError):\n    pass\n\n\nclass B(KVTransferError, ValueError):"
        "\n    pass\n\n\nclass C(x.TransportError, RuntimeError):\n    pass\n"
    )
    assert unimportable_violations(path, {"KVTransferError", "TransportError"}) == ["worker.py: A"]


def test_builtin_bases_stay_for_callers_that_catch_them() -> None:
    from bidir_kv.bench.distributions import DistributionError
    from bidir_kv.config import ConfigError
    from bidir_kv.launch.process import ProcessFailed
    from bidir_kv.protocol import ProtocolError
    from bidir_kv.router.store import StoreError
    from bidir_kv.testing.poll import WaitTimeout

    assert ConfigError is errors.ConfigError
    for cls, builtin in [
        (ConfigError, ValueError),
        (DistributionError, ValueError),
        (ProtocolError, ValueError),
        (StoreError, RuntimeError),
        (ProcessFailed, RuntimeError),
        (WaitTimeout, AssertionError),
    ]:
        assert issubclass(cls, builtin), cls


# ---- HTTP: one translation per server -------------------------------------------


def _engine(exc: BidirKVError) -> tuple[int, dict[str, object]]:
    from bidir_kv.engine.server import error_response_for

    resp = error_response_for(exc)
    assert resp.content_type == "application/json"
    assert isinstance(resp.body, bytes)
    return resp.status, json.loads(resp.body)


def _router(exc: BidirKVError) -> tuple[int, dict[str, object]]:
    from bidir_kv.router.failures import error_response_for

    resp = error_response_for(exc)
    assert resp.content_type == "application/json"
    assert resp.text is not None
    return resp.status, json.loads(resp.text)


def _engine_body(status: int, message: str, kind: str) -> dict[str, object]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def _router_body(status: int, message: str, kind: str) -> dict[str, object]:
    return {"error": {"message": message, "type": kind, "code": status}}


def _engine_cases() -> list[tuple[BidirKVError, int, str, str]]:
    from bidir_kv.engine.api import ApiError
    from bidir_kv.engine.faults import FaultError
    from bidir_kv.engine.model import ChatTemplateError
    from bidir_kv.engine.request import RequestError
    from bidir_kv.intake import InputError

    return [
        # area defaults
        (errors.ConfigError("bad"), 400, "bad", "BadRequestError"),
        (errors.IntakeError("bad"), 400, "bad", "BadRequestError"),
        (errors.EngineError("boom"), 500, "Internal server error", "InternalServerError"),
        # what the engine raises today
        (
            FaultError("drop_rate: expected a number"),
            400,
            "drop_rate: expected a number",
            "BadRequestError",
        ),
        (ChatTemplateError("no bad roles"), 400, "no bad roles", "BadRequestError"),
        (InputError(400, "not JSON"), 400, "not JSON", "BadRequestError"),
        (InputError(413, "too big"), 413, "too big", "RequestEntityTooLarge"),
        (InputError(415, "charset"), 415, "charset", "UnsupportedMediaType"),
        (ApiError(400, "'n' must be 1"), 400, "'n' must be 1", "BadRequestError"),
        (
            ApiError(404, "The model `x` does not exist.", "NotFoundError"),
            404,
            "The model `x` does not exist.",
            "NotFoundError",
        ),
        (RequestError(400, "too long"), 400, "too long", "BadRequestError"),
        (
            RequestError(500, "Internal server error"),
            500,
            "Internal server error",
            "InternalServerError",
        ),
        (RequestError(503, "waited"), 503, "waited", "ServiceUnavailableError"),
    ]


def _router_cases() -> list[tuple[BidirKVError, int, str, str]]:
    from bidir_kv.intake import InputError
    from bidir_kv.router.failures import Cause, UpstreamFailure
    from bidir_kv.router.identity import IdentityError
    from bidir_kv.router.store import StoreError

    return [
        # area defaults
        (errors.IntakeError("bad"), 400, "bad", "BadRequestError"),
        (errors.RouterError("down"), 502, "down", "BadGateway"),
        # what the router raises today
        (InputError(400, "'n' must be 1"), 400, "'n' must be 1", "BadRequestError"),
        (InputError(413, "too big"), 413, "too big", "RequestEntityTooLarge"),
        (InputError(415, "charset"), 415, "charset", "UnsupportedMediaType"),
        (
            IdentityError("conversation_id must be a string"),
            400,
            "conversation_id must be a string",
            "BadRequestError",
        ),
        (StoreError("redis down"), 503, "redis down", "ServiceUnavailable"),
        (UpstreamFailure(Cause.TIMEOUT, "slow"), 504, "slow", "GatewayTimeout"),
        (UpstreamFailure(Cause.UNREACHABLE, "gone"), 502, "gone", "BadGateway"),
        (UpstreamFailure(Cause.BAD_RESPONSE, "junk", 200, b"{}"), 502, "junk", "BadGateway"),
    ]


@pytest.mark.parametrize("case", range(len(_engine_cases())))
def test_engine_translation(case: int) -> None:
    exc, status, message, kind = _engine_cases()[case]
    assert _engine(exc) == (status, _engine_body(status, message, kind))


@pytest.mark.parametrize("case", range(len(_router_cases())))
def test_router_translation(case: int) -> None:
    exc, status, message, kind = _router_cases()[case]
    assert _router(exc) == (status, _router_body(status, message, kind))
