"""Where this checkout's files are: the one place the repository's root is computed.

``REPO_ROOT`` is the folder that holds ``bidir_kv/``: in a source checkout the repository,
whose ``out/`` takes reports and logs and whose root goes on a vLLM server's ``PYTHONPATH``
when it loads our connector from this checkout (docs/connector.md §1).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["REPO_ROOT"]

REPO_ROOT = Path(__file__).resolve().parents[1]
