"""The built wheel, installed into a fresh virtual environment, runs its commands.

Why: an editable install and the checkout's ``PYTHONPATH`` hide every file the wheel
leaves out. This builds the wheel from a copy of the sources, installs it (its
dependencies from the package index, through pip's cache) into a new venv outside the
checkout, and runs the shipped commands from a directory outside the checkout with no
``PYTHONPATH``: ``plan --profile`` (a packaged cost profile), ``engine`` with its
default profile answering one completion, and ``demo --help``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bidir_kv.launch.process import ManagedProcess, free_port, wait_http_ok
from bidir_kv.paths import REPO_ROOT

pytestmark = pytest.mark.integration

# what the wheel is built from: the package and the files pyproject.toml names
SOURCES = ("pyproject.toml", "README.md", "bidir_kv")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built from a copy of its sources (the checkout stays clean)."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    dist = work / "dist"
    pip(sys.executable, "wheel", "--no-deps", "--wheel-dir", str(dist), str(src))
    (built,) = dist.glob("bidir_kv-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv (outside the checkout) holding the wheel and its dependencies; its bin."""
    root = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    # pip of this venv drives the new one (no ensurepip); no byte-compiling of every
    # dependency: the commands compile what they import
    pip(sys.executable, "--python", str(python), "install", "--no-compile", str(wheel))
    return root / "bin"


def pip(python: str, *args: str) -> None:
    """Run pip quietly (its cache on, its version check off); fail with its output."""
    env = {**clean_env(), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run(
        [python, "-m", "pip", "-q", *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, f"pip {' '.join(args)}:\n{done.stdout}\n{done.stderr}"


def clean_env() -> dict[str, str]:
    """This environment without what would make the checkout importable."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


@pytest.fixture
def outside(tmp_path: Path, venv: Path) -> tuple[Path, dict[str, str]]:
    """A working directory outside the checkout and an environment using the venv only."""
    env = {**clean_env(), "PATH": f"{venv}{os.pathsep}{os.environ['PATH']}"}
    assert REPO_ROOT not in tmp_path.parents
    return tmp_path, env


def command(outside: tuple[Path, dict[str, str]], *args: str) -> subprocess.CompletedProcess[str]:
    cwd, env = outside
    return subprocess.run(
        ["bidir-kv", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_package_is_the_installed_one(outside: tuple[Path, dict[str, str]], venv: Path) -> None:
    cwd, env = outside
    done = subprocess.run(
        [str(venv / "python"), "-c", "import bidir_kv; print(bidir_kv.__file__)"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(done.stdout.strip()).is_relative_to(venv.parent)


def test_plan_reads_a_packaged_profile(outside: tuple[Path, dict[str, str]]) -> None:
    done = command(outside, "plan", "--profile", "qwen3-32b-p5en")
    assert done.returncode == 0, done.stderr
    assert "qwen3-32b-p5en" in done.stdout
    assert "break-even" in done.stdout


def test_demo_help(outside: tuple[Path, dict[str, str]]) -> None:
    done = command(outside, "demo", "--help")
    assert done.returncode == 0, done.stderr
    assert "--profile" in done.stdout and "--time-scale" in done.stdout


@pytest.fixture
def engine(outside: tuple[Path, dict[str, str]]) -> Iterator[str]:
    """``bidir-kv engine`` with its default profile on a free loopback port; its URL."""
    cwd, env = outside
    port = free_port()
    env = {
        **env,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
    }
    proc = ManagedProcess(
        "engine",
        ["bidir-kv", "engine", "wheel-model", "--host", "127.0.0.1", "--port", str(port)],
        cwd / "engine.log",
        env=env,
        cwd=cwd,
    ).start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", 60, alive=proc)
        yield url
    finally:
        proc.stop()


def test_engine_answers_a_turn_with_its_default_profile(engine: str) -> None:
    body = {"model": "wheel-model", "prompt": "Hello from the wheel", "max_tokens": 4}
    resp = httpx.post(f"{engine}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["choices"][0]["text"]
    assert answer["usage"]["completion_tokens"] == 4
