"""The sweep's console progress: a rich bar on a terminal, plain status lines otherwise."""

from __future__ import annotations

import sys
from typing import Any

from bidir_kv.bench.stats import RequestRecord

__all__ = ["Progress"]


class Progress:
    """A rich progress bar (or nothing); ``advance`` is called once per request."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        self._task: Any = None
        if enabled and sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("bench", total=total)

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)
        else:
            print(text, file=sys.stderr, flush=True)

    def advance(self, _: RequestRecord) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
