"""What a client sends, read and checked once for every server that takes it.

Reading path: ``body`` (read with a cap, decode, refuse hostile JSON), then ``fields``
(vLLM's rules for each request field); ``errors`` is the one exception.

The router and the emulated engine answer the same hostile or invalid bodies with
the same 4xx and the same words: the router refuses exactly what an engine would,
before any engine spends a prefill on it. Pure checks (``body.decode_json``,
``fields.check_request``) plus one capped aiohttp read (``body.read_capped``).
"""

from bidir_kv.intake.body import MAX_JSON_DEPTH, decode_json, read_capped
from bidir_kv.intake.errors import InputError
from bidir_kv.intake.fields import check_request

__all__ = ["MAX_JSON_DEPTH", "InputError", "check_request", "decode_json", "read_capped"]
