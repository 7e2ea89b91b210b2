"""The tiny Hugging Face tokenizer as a fixture (``tiny_tokenizer_dir``).

Built once per session (per xdist worker) in this process by ``fixtures/tiny_model.py``'s
``build_tokenizer``: a byte-level BPE trained on the fixture's corpus with ``tokenizers``
(well under a second; docs/vllm-cpu.md §4.1). :func:`build_tiny_tokenizer_apart` builds
it the way ``make tokenizer`` does, in a child process where ``torch`` and
``transformers`` cannot be imported: the promise that building it needs neither
(suites/integration/test_hf_tokenizer_transformers.py).
"""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

__all__ = ["TINY_MODEL_SCRIPT", "build_tiny_tokenizer_apart", "tiny_tokenizer_dir"]

TINY_MODEL_SCRIPT = Path(__file__).resolve().parents[2] / "fixtures" / "tiny_model.py"
_APART = """
import runpy, sys
sys.modules["torch"] = None  # any import of these now raises ImportError
sys.modules["transformers"] = None
script, out = sys.argv[1:]
sys.argv = [script, "--tokenizer-only", "--out", out]
runpy.run_path(script, run_name="__main__")
"""


def build_tiny_tokenizer_apart(out: Path) -> Path:
    """Build the tiny tokenizer into ``out`` in a child process without torch or
    transformers (``fixtures/tiny_model.py --tokenizer-only``)."""
    subprocess.run(
        [sys.executable, "-c", _APART, str(TINY_MODEL_SCRIPT), str(out)], check=True, timeout=120
    )
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the tiny tokenizer (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json), built for this session."""
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    runpy.run_path(str(TINY_MODEL_SCRIPT))["build_tokenizer"](out)
    return out
