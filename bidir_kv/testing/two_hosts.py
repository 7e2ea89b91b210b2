"""Fixtures: two hosts on this machine (:mod:`bidir_kv.testing.netns`) and nodes placed on
D's host through the ``ssh`` launcher, stopped at teardown even when the test fails.

* ``two_hosts`` (session): D's namespace, the veth pair, sshd; skips (or fails under
  ``--require-tier``) where the machine cannot make them.
* ``ssh_launch`` (per test): ``ssh_launch(cmd, name=...)`` starts ``cmd`` on D's host and
  returns its :class:`~bidir_kv.launch.ssh.SshNode`; every node it started is
  stopped by its pidfile at teardown and its log fetched into the test's run dir.
* :func:`emulator_command`: ``bidir-kv serve``'s builder output for the emulated engine
  (``bidir-kv engine`` takes ``vllm serve``'s flags), so the emulator is placed with the
  same command a release run places, only the executable differs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from bidir_kv.launch.remote import Command, LaunchFailed
from bidir_kv.launch.ssh import SshHost, SshLauncher, SshNode, stop_all
from bidir_kv.paths import REPO_ROOT
from bidir_kv.serve.command import ServeCommand, ServeSpec, build
from bidir_kv.testing.gating import skip_or_fail
from bidir_kv.testing.netns import TwoHosts, TwoHostsUnavailable

__all__ = ["emulator_command", "ssh_host", "ssh_launch", "two_hosts"]


def emulator_command(spec: ServeSpec, *extra: str, python: str = sys.executable) -> ServeCommand:
    """``build(spec)`` with ``vllm serve`` swapped for ``python -m bidir_kv engine`` and
    the emulator's own flags (``extra``, e.g. ``--transport tcp``) appended."""
    cmd = build(spec)
    argv = (python, "-m", "bidir_kv", "engine", *cmd.argv[2:], *extra)
    env = {**cmd.env, "PYTHONPATH": str(REPO_ROOT)}
    return replace(cmd, argv=argv, env=env)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (a CI job cancelled, a ``timeout``) ends the session as Ctrl-C does, so
    fixtures tear down: nodes on other hosts are stopped by their pidfiles and the two
    hosts are removed, instead of outliving a killed runner."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _terminate)


def _tier(request: pytest.FixtureRequest) -> str:
    return "hardware" if "hardware" in request.node.keywords else "integration"


@pytest.fixture(scope="session")
def two_hosts(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TwoHosts]:
    try:
        hosts = TwoHosts(tmp_path_factory.mktemp("two-hosts")).__enter__()
    except TwoHostsUnavailable as exc:
        skip_or_fail(request.config, _tier(request), f"two hosts on this machine: {exc}")
    try:
        yield hosts
    finally:
        hosts.__exit__(None, None, None)


def ssh_host(hosts: TwoHosts) -> SshHost:
    """D's host as the ssh launcher dials it."""
    assert hosts.ssh is not None
    return SshHost(hosts.d_addr, user=hosts.ssh.user, options=hosts.ssh.options)


@pytest.fixture
def ssh_launch(two_hosts: TwoHosts, run_dir: Path) -> Iterator[Callable[..., SshNode]]:
    launcher = SshLauncher(ssh_host(two_hosts), run_dir=str(run_dir / "remote"))
    started: list[SshNode] = []

    def start(cmd: Command, *, name: str) -> SshNode:
        node = launcher.start(cmd, name=name, base_env={"PATH": os.environ.get("PATH", "")})
        started.append(node)
        return node

    try:
        yield start
    finally:
        for node in started:
            with contextlib.suppress(LaunchFailed):  # the log is a courtesy; stop anyway
                node.fetch_log(run_dir / f"{node.name}.log")
        stop_all(started)
