"""The one exception of :mod:`bidir_kv.intake`."""

from __future__ import annotations

from bidir_kv.errors import IntakeError

__all__ = ["InputError"]

# The OpenAI-style error type vLLM uses for a status other than 400.
_TYPES = {413: "RequestEntityTooLarge", 415: "UnsupportedMediaType"}


class InputError(IntakeError):
    """A request answered with a 4xx; ``message`` names the problem, ``param`` the field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.http_status = status
        self.error_type = _TYPES.get(status, "BadRequestError")
        self.message = message
        self.param = param
