"""The one exception of :mod:`bidir_kv.intake`."""

from __future__ import annotations

__all__ = ["InputError"]


class InputError(Exception):
    """A request answered with a 4xx; ``message`` names the problem, ``param`` the field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def kind(self) -> str:
        """The OpenAI-style error type vLLM uses for this status."""
        return {413: "RequestEntityTooLarge", 415: "UnsupportedMediaType"}.get(
            self.status, "BadRequestError")
