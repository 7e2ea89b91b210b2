"""What every launcher shares: the command it places, the handle it returns, its error.

A launcher never builds a node's command: ``bidir-kv serve``'s builder
(:func:`bidir_kv.serve.command.build`) is the one place that happens, and any object with
its ``argv`` and ``env`` (:class:`Command`) can be placed. The handle stops what the
launcher started (idempotent) and fetches the node's log back to this machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from bidir_kv.launch.process import ProcessFailed

__all__ = ["Command", "LaunchFailed", "NodeHandle", "one_line"]


class Command(Protocol):
    """A node's command line and the variables added to its environment."""

    @property
    def argv(self) -> Sequence[str]: ...

    @property
    def env(self) -> Mapping[str, str]: ...


class NodeHandle(Protocol):
    """One placed node."""

    name: str

    @property
    def where(self) -> str:
        """ "ssh root@10.0.0.2 pid 7", "slurm job 12 step 0 on node-a", "pod ns/bkv-p"."""
        ...

    def stop(self, timeout: float = 30.0) -> str:
        """Stop the node (again: a no-op); one line saying what happened."""
        ...

    def fetch_log(self, dest: Path) -> Path:
        """Copy the node's log to ``dest`` on this machine and return ``dest``."""
        ...


class LaunchFailed(ProcessFailed):
    """A node could not be placed or started; the first line names the host and cause."""


def one_line(text: str, fallback: str) -> str:
    """The last non-empty line of a tool's stderr (where OpenSSH, srun and kubectl put
    the reason), or ``fallback``."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else fallback
