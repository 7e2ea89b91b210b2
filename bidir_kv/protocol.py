"""The one model of vLLM's ``kv_transfer_params`` and where it travels.

Every component (engine, router, suites, bench) reads and writes the dict through
:class:`KVTransferParams`; nobody indexes raw dicts elsewhere. The model keeps
track of which keys were present, so ``parse(d).to_dict() == d`` holds for every
valid input, unknown keys included (vLLM adds fields between versions, e.g.
``remote_registration_generation`` in 0.33).

Field semantics follow vLLM 0.33 (docs/protocol.md §3.6; the dict shapes are §3.3-§3.5).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Final

from bidir_kv.errors import KVTransferError
from bidir_kv.wire.ids import BlockIds, EngineId, RequestId

__all__ = [
    "KNOWN_FIELDS",
    "REQUIRED_REMOTE_FIELDS",
    "KVTransferParams",
    "ParamsKind",
    "ProtocolError",
    "TerminalChunk",
    "iter_sse_data",
    "might_be_terminal",
    "params_from_request",
    "params_from_response",
    "parse_kv_transfer_params",
    "scan_terminal_chunk",
]

_MISSING: Final = object()


class ProtocolError(KVTransferError, ValueError):
    """Invalid ``kv_transfer_params``; ``field`` names the offending key."""

    def __init__(self, field_name: str, problem: str) -> None:
        self.field = field_name
        self.problem = problem
        super().__init__(f"kv_transfer_params.{field_name}: {problem}")


class ParamsKind(StrEnum):
    """Which of the protocol's dict shapes a params object is."""

    MISS = "miss"  # router -> P, nothing cached for the conversation
    PREFILL = "prefill"  # P-node dict: "the next node must pull from me"
    DECODE = "decode"  # D-node dict (or the hit dict router -> P)
    OTHER = "other"


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_block_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(g, list) and _block_group(g) for g in v)


def _block_group(g: list[Any]) -> bool:
    """Non-negative ints. A 24k-token prompt names ~1,500 blocks: the usual exact ints
    are checked in one C pass (``map``, ``min``); anything else item by item."""
    if set(map(type, g)) <= {int}:
        return not g or min(g) >= 0
    return all(_is_int(b) and b >= 0 for b in g)


_FIELDS: Final[dict[str, tuple[Any, bool, str]]] = {
    # name: (checker, nullable, expected-type text); wire order, cosmetic only
    "do_remote_prefill": (_is_bool, False, "a boolean"),
    "do_remote_decode": (_is_bool, False, "a boolean"),
    "remote_block_ids": (_is_block_ids, True, "a list of lists of non-negative ints"),
    "remote_engine_id": (_is_str, True, "a string"),
    "remote_request_id": (_is_str, True, "a string"),
    "remote_host": (_is_str, True, "a string"),
    "remote_port": (_is_int, True, "an integer"),
    "tp_size": (_is_int, False, "an integer"),
    "dcp_size": (_is_int, False, "an integer"),
    "pp_size": (_is_int, False, "an integer"),
    "remote_num_tokens": (_is_int, True, "an integer"),
    "remote_blocks_expiry_time": (_is_num, True, "a number"),
    "remote_registration_generation": (_is_int, True, "an integer"),
    "transfer_mode": (_is_str, True, "a string"),
    "remote_prefill_cached_tokens": (_is_int, True, "an integer"),
}
KNOWN_FIELDS: Final = tuple(_FIELDS)
REQUIRED_REMOTE_FIELDS: Final = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)
_POSITIVE = ("tp_size", "dcp_size", "pp_size")
_NON_NEGATIVE = ("remote_num_tokens", "remote_port", "remote_prefill_cached_tokens")


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """A parsed ``kv_transfer_params`` object.

    ``present`` records which known keys the wire form carried; attributes of
    absent keys hold their vLLM defaults, so consumers can read them directly.
    ``extra`` keeps unknown keys verbatim for the round trip.
    """

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_block_ids: BlockIds | None = None
    remote_engine_id: EngineId | None = None
    remote_request_id: RequestId | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1
    remote_num_tokens: int | None = None
    remote_blocks_expiry_time: float | None = None
    remote_registration_generation: int | None = None
    transfer_mode: str | None = None
    remote_prefill_cached_tokens: int | None = None
    present: frozenset[str] = field(default_factory=frozenset)
    extra: Mapping[str, Any] = field(default_factory=dict)

    # ---- construction -------------------------------------------------------

    @classmethod
    def parse(cls, obj: Any) -> KVTransferParams:
        """Validate a decoded JSON object; raise :class:`ProtocolError` naming the field."""
        if not isinstance(obj, Mapping):
            raise ProtocolError("<root>", f"expected a JSON object, got {type(obj).__name__}")
        values: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in obj.items():
            if not isinstance(key, str):
                raise ProtocolError(repr(key), "keys must be strings")
            spec = _FIELDS.get(key)
            if spec is None:
                extra[key] = value
                continue
            check, nullable, expected = spec
            if value is None:
                if not nullable:
                    raise ProtocolError(key, f"must be {expected}, got null")
            elif not check(value):
                raise ProtocolError(key, f"must be {expected}, got {_describe(value)}")
            elif key in _POSITIVE and value < 1:
                raise ProtocolError(key, f"must be >= 1, got {value}")
            elif key in _NON_NEGATIVE and value < 0:
                raise ProtocolError(key, f"must be >= 0, got {value}")
            values[key] = value
        if "remote_block_ids" in values and values["remote_block_ids"] is not None:
            values["remote_block_ids"] = [list(g) for g in values["remote_block_ids"]]
        expiry = values.get("remote_blocks_expiry_time")
        if expiry is not None:
            values["remote_blocks_expiry_time"] = float(expiry)
        return cls(**values, present=frozenset(values), extra=extra)

    @classmethod
    def build(cls, **fields: Any) -> KVTransferParams:
        """Create from keyword fields, validated exactly like :meth:`parse`."""
        return cls.parse(fields)

    @classmethod
    def miss(cls) -> KVTransferParams:
        """The dict a router sends to P when it holds nothing for the conversation."""
        return cls.parse(
            {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
        )

    # ---- serialisation ------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Wire form: only the keys that were present, then unknown keys."""
        out: dict[str, Any] = {}
        for name in KNOWN_FIELDS:
            if name in self.present:
                value = getattr(self, name)
                if name == "remote_block_ids" and value is not None:
                    value = [list(g) for g in value]
                out[name] = value
        out.update(self.extra)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def with_fields(self, **changes: Any) -> KVTransferParams:
        """A copy with some fields set (they become present); validated."""
        merged = self.to_dict()
        merged.update(changes)
        return KVTransferParams.parse(merged)

    def without_fields(self, *names: str) -> KVTransferParams:
        merged = {k: v for k, v in self.to_dict().items() if k not in names}
        return KVTransferParams.parse(merged)

    def with_remote_host(self, host: str) -> KVTransferParams:
        """A copy with ``remote_host`` set, without re-validating the other fields.

        The router rewrites ``remote_host`` on every request (upstream proxy
        behaviour); the rest of the object was validated when it was parsed.
        """
        if not isinstance(host, str):
            raise ProtocolError("remote_host", f"must be a string, got {_describe(host)}")
        return replace(self, remote_host=host, present=self.present | {"remote_host"})

    def for_prefill_hit(self, decode_http_host: str | None = None) -> KVTransferParams:
        """D's stored dict turned into the hit dict for P on the next turn.

        Mirrors the upstream proxy: force ``do_remote_decode`` true and
        ``do_remote_prefill`` false, and (optionally) point ``remote_host`` at the
        host the router used to reach D.
        """
        changes: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
        if decode_http_host is not None:
            changes["remote_host"] = decode_http_host
        return self.with_fields(**changes)

    # ---- interpretation -----------------------------------------------------

    @property
    def kind(self) -> ParamsKind:
        if self.do_remote_prefill:
            return ParamsKind.PREFILL
        if self.do_remote_decode:
            return ParamsKind.DECODE if self.remote_block_ids else ParamsKind.MISS
        return ParamsKind.OTHER

    @property
    def has_remote_blocks(self) -> bool:
        return bool(self.remote_block_ids) and any(self.remote_block_ids or [])

    def missing_remote_fields(self) -> tuple[str, ...]:
        """Required keys absent from the wire form (vLLM requires presence, not value)."""
        return tuple(k for k in REQUIRED_REMOTE_FIELDS if k not in self.present)

    @property
    def is_valid_remote(self) -> bool:
        """vLLM's validity test on P/D: the four keys present and block ids non-empty.

        When false, vLLM logs ``Got invalid KVTransferParams: ...`` and proceeds
        without transfer.
        """
        return not self.missing_remote_fields() and bool(self.remote_block_ids)

    @property
    def num_remote_tokens(self) -> int:
        """``remote_num_tokens`` with vLLM's reading: missing or null is 0."""
        return self.remote_num_tokens or 0

    @property
    def num_blocks(self) -> int:
        """Block count of group 0 (what the upstream proxy logs)."""
        if not self.remote_block_ids:
            return 0
        return len(self.remote_block_ids[0])


def _describe(value: Any) -> str:
    text = json.dumps(value) if _jsonable(value) else repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# ---- where params travel ------------------------------------------------------


def parse_kv_transfer_params(obj: Any) -> KVTransferParams | None:
    """``None`` for JSON null/absent, else a validated :class:`KVTransferParams`."""
    if obj is None:
        return None
    return KVTransferParams.parse(obj)


def params_from_request(body: Mapping[str, Any]) -> KVTransferParams | None:
    """Params attached to an OpenAI-style request body (top-level key)."""
    return parse_kv_transfer_params(body.get("kv_transfer_params"))


def params_from_response(body: Mapping[str, Any]) -> KVTransferParams | None:
    """Params on a non-streaming completion object (top-level key, may be null)."""
    return parse_kv_transfer_params(body.get("kv_transfer_params"))


@dataclass(frozen=True, slots=True)
class TerminalChunk:
    """An SSE chunk that carries a ``finish_reason``, with its decoded body."""

    body: dict[str, Any]
    finish_reason: str
    params: KVTransferParams | None

    def without_params(self) -> dict[str, Any]:
        body = dict(self.body)
        body.pop("kv_transfer_params", None)
        return body

    def with_params(self, params: KVTransferParams | None) -> dict[str, Any]:
        body = dict(self.body)
        body["kv_transfer_params"] = None if params is None else params.to_dict()
        return body


_PARAMS_KEY: Final = b'"kv_transfer_params"'
_FINISH_KEY: Final = b'"finish_reason"'


def _value_after(data: bytes, key: bytes) -> Iterator[int]:
    """Yield the byte value that follows each ``"key":`` in ``data``."""
    start = 0
    while True:
        i = data.find(key, start)
        if i < 0:
            return
        j = i + len(key)
        n = len(data)
        while j < n and data[j] in b" \t\r\n:":
            j += 1
        if j < n:
            yield data[j]
        start = j


def might_be_terminal(data: bytes) -> bool:
    """Cheap byte test: could this SSE ``data`` payload be a terminal chunk?

    True when some ``finish_reason`` or ``kv_transfer_params`` value is not
    ``null``. False positives are fine (the caller then parses); false negatives
    are not possible for valid JSON whose keys are written without ``\\u``
    escapes (what vLLM's and every common serializer emit; a key spelled
    ``"finish\\u005freason"`` would be missed), so the router's hot path only
    decodes JSON for candidate terminal chunks.
    """
    null = ord("n")
    return any(v != null for v in _value_after(data, _FINISH_KEY)) or any(
        v != null for v in _value_after(data, _PARAMS_KEY)
    )


def scan_terminal_chunk(data: bytes | str) -> TerminalChunk | None:
    """Parse one SSE ``data:`` payload; return it if it is the terminal chunk.

    vLLM 0.33 (PR #40186) puts ``kv_transfer_params`` at the top level of the
    chunk whose choice has a non-null ``finish_reason``. A chunk that carries only
    params (no choices) is also accepted, as the upstream proxy does.
    """
    raw = data.encode() if isinstance(data, str) else data
    raw = raw.strip()
    if not raw or raw == b"[DONE]" or not might_be_terminal(raw):
        return None
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ProtocolError("<sse>", f"chunk is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        return None
    finish: str | None = None
    for choice in body.get("choices") or ():
        if isinstance(choice, dict) and choice.get("finish_reason") is not None:
            finish = str(choice["finish_reason"])
            break
    params = parse_kv_transfer_params(body.get("kv_transfer_params"))
    if finish is None and params is None:
        return None
    return TerminalChunk(body=body, finish_reason=finish or "", params=params)


def iter_sse_data(lines: Iterable[bytes | str]) -> Iterator[bytes]:
    """Yield the payload of each ``data:`` line (``[DONE]`` included)."""
    for line in lines:
        raw = line.encode() if isinstance(line, str) else line
        raw = raw.rstrip(b"\r\n")
        if raw.startswith(b"data:"):
            yield raw[5:].lstrip(b" ")
