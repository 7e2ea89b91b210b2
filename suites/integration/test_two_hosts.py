"""Two hosts on one machine: D placed through the ``ssh`` launcher in its own network
namespace, P here; a D->P read crosses the veth and P's interface counters show it.

The emulated engine (``bidir-kv engine``, TCP transport) is placed with the command
``bidir-kv serve``'s builder makes (bidir_kv/testing/two_hosts.py). The fabric gate
(bidir_kv/fabric/counters.py) passes on P's veth counters, and fails on the same counters when P
and D share one host (loopback): the negative control.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bidir_kv.doctor.checks import Context
from bidir_kv.doctor.cli import run
from bidir_kv.fabric.counters import (
    INTERFACE_OVERHEAD,
    FabricFailure,
    gate_fabric,
    interface_counters,
    read_counters,
)
from bidir_kv.fabric.probe import local_probe
from bidir_kv.launch.process import free_port, process_running
from bidir_kv.launch.remote import LaunchFailed
from bidir_kv.launch.ssh import SshLauncher, SshNode
from bidir_kv.paths import REPO_ROOT
from bidir_kv.serve.command import ServeSpec
from bidir_kv.testing.emulated_read import (
    EMULATOR,
    LocalNodes,
    client,
    measured_read,
    node_spec,
)
from bidir_kv.testing.netns import TwoHosts
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.testing.poll import wait_for
from bidir_kv.testing.two_hosts import emulator_command, ssh_host

pytestmark = pytest.mark.slow


@pytest.fixture
def local_node(run_dir: Path) -> Iterator[Callable[[ServeSpec], EngineClient]]:
    """The ``local`` launcher: a node on this host (one host, no fabric)."""
    nodes = LocalNodes(run_dir)
    try:
        yield nodes.start
    finally:
        nodes.close()


def test_d_on_its_host_through_ssh_reads_cross_the_veth(
    two_hosts: TwoHosts,
    ssh_launch: Callable[..., SshNode],
    local_node: Callable[[ServeSpec], EngineClient],
    run_dir: Path,
) -> None:
    hosts = two_hosts
    d_spec = node_spec("decode", hosts.d_addr, hosts.d_addr, 8200, 5601)
    node = ssh_launch(emulator_command(d_spec, *EMULATOR), name="decode")
    # P's HTTP on its veth address too: D calls back to it (the emulator's claim); this
    # process reaches it through the local route, not across the veth
    p = local_node(
        node_spec(
            "prefill", hosts.p_addr, hosts.p_addr, free_port(hosts.p_addr), free_port(hosts.p_addr)
        )
    )
    d_url = f"http://{hosts.d_addr}:8200"
    node.wait_healthy(d_url + "/health", 60, log_copy=run_dir / "decode.log")
    d = client("decode", hosts.d_addr, 8200)
    assert hosts.d_addr in node.where and node.running()

    counters = interface_counters(hosts.p_if)
    delta, expected = measured_read(p, d, lambda: read_counters(counters), "two-hosts")
    counted = gate_fabric(delta, expected, INTERFACE_OVERHEAD, what=f"P's interface {hosts.p_if}")
    assert counted >= expected

    # the node ran in D's namespace with the recipe's environment, and its log comes back
    log = node.fetch_log(run_dir / "decode-fetched.log").read_text()
    assert log.strip(), "the decode node's log came back empty"
    environ = Path(f"/proc/{node.pid}/environ").read_bytes().split(b"\0")
    assert f"VLLM_NIXL_SIDE_CHANNEL_HOST={hosts.d_addr}".encode() in environ
    assert os.stat(f"/proc/{node.pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
    assert node.pid in hosts.pids_in_d()
    assert "stopped" in node.stop(10)
    assert node.pid not in hosts.pids_in_d()


def test_negative_control_one_host_fails_the_fabric_gate(
    two_hosts: TwoHosts,
    local_node: Callable[[ServeSpec], EngineClient],
) -> None:
    """P and D on one host: the read goes over loopback, the veth's counters stay flat,
    and the gate fails naming the interface and its counter."""
    hosts = two_hosts
    lo = "127.0.0.1"
    d = local_node(node_spec("decode", lo, lo, free_port(), free_port()))
    p = local_node(node_spec("prefill", lo, lo, free_port(), free_port()))
    counters = interface_counters(hosts.p_if)
    delta, expected = measured_read(p, d, lambda: read_counters(counters), "one-host")
    with pytest.raises(FabricFailure) as failure:
        gate_fabric(delta, expected, INTERFACE_OVERHEAD, what=f"P's interface {hosts.p_if}")
    text = str(failure.value)
    assert f"{hosts.p_if} rx_bytes" in text and f"{expected:,}" in text, text


@pytest.mark.parametrize("case", ["refused login", "unreachable host"])
def test_bad_ssh_target_fails_once_in_one_line_and_leaves_nothing(
    two_hosts: TwoHosts,
    case: str,
    run_dir: Path,
) -> None:
    hosts = two_hosts
    good = ssh_host(hosts)
    assert hosts.bad_ssh is not None
    target = (
        good.__class__(hosts.d_addr, user="root", options=hosts.bad_ssh.options)
        if case == "refused login"
        else good.__class__(hosts.spare_addr, user="root", options=good.options)
    )
    before = sorted(hosts.wait_ssh_sessions_closed())
    spec = node_spec("decode", hosts.d_addr, hosts.d_addr, 8200, 5601)
    remote = run_dir / "remote"
    with pytest.raises(LaunchFailed) as failure:
        SshLauncher(target, run_dir=str(remote)).start(
            emulator_command(spec, *EMULATOR), name="decode"
        )
    text = str(failure.value)
    assert "\n" not in text and text.startswith(f"ssh root@{target.host}: "), text
    cause = "Permission denied" if case == "refused login" else "No route to host"
    assert cause in text, text
    # nothing started, and no sshd session left behind by the failed connection
    assert sorted(hosts.wait_ssh_sessions_closed()) == before
    assert not remote.exists()


_INNER = """
import threading
from pathlib import Path

from bidir_kv.testing.two_hosts import emulator_command
from bidir_kv.fabric.probe import local_probe
from bidir_kv.serve.command import ServeSpec

OUT = Path({out!r})


def _start(ssh_launch, two_hosts, name, port):
    spec = ServeSpec(role="decode", model="tiny", ip=two_hosts.d_addr, host=two_hosts.d_addr,
                     port=port, side_channel_port=port + 1)
    node = ssh_launch(emulator_command(spec, "--transport", "tcp"), name=name)
    (OUT / f"{{name}}.pid").write_text(str(node.pid))


def test_fails(ssh_launch, two_hosts):
    _start(ssh_launch, two_hosts, "failing", 8300)
    assert False, "planted failure"


def test_interrupted(ssh_launch, two_hosts):
    _start(ssh_launch, two_hosts, "interrupted", 8400)
    threading.Event().wait(120)  # blocks until the outer test interrupts this run
"""


def _ctrl_c_as_at_a_terminal() -> None:
    """The inner run takes SIGINT as a user's Ctrl-C whatever this run inherited: a suite
    started in the background (``nohup make test &``) ignores SIGINT, an ignored signal
    stays ignored across exec, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ssh_nodes_are_stopped_when_the_test_fails_or_is_interrupted(
    tmp_path: Path,
    sig: signal.Signals,
) -> None:
    """A pytest run whose first test fails and whose second is interrupted (Ctrl-C, or a
    cancelled CI job's SIGTERM) still stops both nodes through their pidfiles on D's host."""
    out = tmp_path / "out"
    out.mkdir()
    inner = tmp_path / "test_inner.py"
    inner.write_text(textwrap.dedent(_INNER.format(out=str(out))))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "bidir_kv.testing.plugin",
            "-q",
            "-o",
            "addopts=",
            "--basetemp",
            str(tmp_path / "inner-tmp"),
            str(inner),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        preexec_fn=_ctrl_c_as_at_a_terminal,
    )
    try:
        wait_for(
            lambda: (out / "interrupted.pid").exists() or proc.poll() is not None,
            180,
            "the inner run's second node",
        )
        assert proc.poll() is None, proc.communicate()[0]
        failing = int((out / "failing.pid").read_text())
        assert not process_running(failing), "the failed test's node still runs"
        interrupted = int((out / "interrupted.pid").read_text())
        assert process_running(interrupted)
        proc.send_signal(sig)
        text = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:  # a failed check above: let the inner run tear down first
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert "planted failure" in text and "KeyboardInterrupt" in text, text
    assert not process_running(interrupted), f"the interrupted test's node still runs\n{text}"


def test_doctor_fabric_check_sees_the_read_cross_the_veth_and_not_loopback(
    two_hosts: TwoHosts,
    ssh_launch: Callable[..., SshNode],
    local_node: Callable[[ServeSpec], EngineClient],
    run_dir: Path,
) -> None:
    """`bidir-kv doctor --fabric if:<P's veth>`: PASS for D on its own host (through ssh),
    FAIL naming the interface and its counter for a pair on loopback."""
    hosts = two_hosts
    node = ssh_launch(
        emulator_command(node_spec("decode", hosts.d_addr, hosts.d_addr, 8200, 5601), *EMULATOR),
        name="decode",
    )
    p = local_node(
        node_spec(
            "prefill", hosts.p_addr, hosts.p_addr, free_port(hosts.p_addr), free_port(hosts.p_addr)
        )
    )
    node.wait_healthy(f"http://{hosts.d_addr}:8200/health", 60)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bidir_kv",
            "doctor",
            "--prefill-url",
            p.url,
            "--decode-url",
            f"http://{hosts.d_addr}:8200",
            "--no-host-checks",
            "--json",
            "--fabric",
            f"if:{hosts.p_if}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    results = {r["name"]: r for r in json.loads(out.stdout)}
    fabric = results["fabric: the D->P read crossed P's NIC"]
    assert fabric["status"] == "PASS", fabric
    assert f"on P's interface {hosts.p_if}" in fabric["detail"]

    lo = "127.0.0.1"
    d1 = local_node(node_spec("decode", lo, lo, free_port(), free_port()))
    p1 = local_node(node_spec("prefill", lo, lo, free_port(), free_port()))
    ctx = Context(
        prefill_url=p1.url,
        decode_url=d1.url,
        host_checks=False,
        fabric=local_probe(f"if:{hosts.p_if}"),
    )
    (fail,) = [r for r in run(ctx) if r.name.startswith("fabric:")]
    assert fail.status == "FAIL" and f"{hosts.p_if} rx_bytes" in fail.detail, fail
