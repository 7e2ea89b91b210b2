"""The scenarios' handle to one engine node: :class:`bidir_kv.client.TokenClient` plus
what only tests need, the node's log and a way to forbid requests while it is paused.

Scenarios talk to any backend (our emulator, real vLLM, an external deployment) the
same way a router does, but without one, so each leg can be observed; the requests,
the result model and the P-then-D turn are :mod:`bidir_kv.client`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from bidir_kv.client import TokenClient
from bidir_kv.client.node import DEFAULT_TIMEOUT
from bidir_kv.topology.base import Node

__all__ = ["EngineClient"]


class EngineClient(TokenClient):
    """HTTP handle to one engine node (P, D or a plain reference server)."""

    def __init__(self, node: Node, model: str = "tiny", timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(node.url, model=model, timeout=timeout)
        self.node = node
        self._unusable: str | None = None
        # called before every request: makes the node's server the running one when
        # servers share cores (bidir_kv/testing/pairs.py)
        self.before_use: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return f"EngineClient({self.node.name} {self.url})"

    @contextlib.contextmanager
    def unusable(self, why: str) -> Iterator[None]:
        """Within the block, any request through this client raises, naming ``why``
        (a paused server would just hang it)."""
        self._unusable = why
        try:
            yield
        finally:
            self._unusable = None

    def _check_usable(self) -> None:
        if self._unusable is not None:
            raise RuntimeError(f"{self.node.name} cannot be used here: {self._unusable}")
        if self.before_use is not None:
            self.before_use()

    def log_mark(self) -> int:
        """Current size of the node's log (for :meth:`log_since`); 0 without a log."""
        path = self.node.log_path
        if not path:
            return 0
        try:
            return Path(path).stat().st_size
        except OSError:
            return 0

    def log_since(self, mark: int) -> str | None:
        """Log text written after ``mark``; ``None`` when the node's log is not ours."""
        path = self.node.log_path
        if not path:
            return None
        with open(path, "rb") as fh:
            fh.seek(mark)
            return fh.read().decode(errors="replace")

    @property
    def has_log(self) -> bool:
        return bool(self.node.log_path)
