"""Two hosts on one machine: D placed through the ``ssh`` launcher in its own network
namespace, P here; a D->P read crosses the veth and P's interface counters show it.

The emulated engine (``bidir-kv engine``, TCP transport) is placed with the command
``bidir-kv serve``'s builder makes (bidir_kv/testing/two_hosts.py). The fabric gate
(bidir_kv/fabric.py) passes on P's veth counters, and fails on the same counters when P
and D share one host (loopback): the negative control.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bidir_kv.fabric import (
    INTERFACE_OVERHEAD,
    FabricFailure,
    deltas,
    gate_fabric,
    interface_counters,
    read_counters,
)
from bidir_kv.policy import blocks_for_tokens
from bidir_kv.serve.command import ServeSpec
from bidir_kv.testing.netns import TwoHosts
from bidir_kv.testing.pd_client import NIXL_BYTES, EngineClient, run_pd_turn, settled_metrics
from bidir_kv.testing.poll import wait_for
from bidir_kv.testing.two_hosts import emulator_command, ssh_host
from bidir_kv.topology.base import Node
from bidir_kv.topology.launch.remote import LaunchFailed
from bidir_kv.topology.launch.ssh import SshLauncher, SshNode
from bidir_kv.topology.process import ManagedProcess, free_port, wait_http_ok

pytestmark = pytest.mark.slow

BLOCK = 16
KV_BYTES_PER_TOKEN = 4096
HISTORY = 2000
REPO = Path(__file__).resolve().parents[2]
EMULATOR = ("--transport", "tcp", "--kv-bytes-per-token", str(KV_BYTES_PER_TOKEN))


def _spec(role: str, ip: str, host: str, port: int, side: int) -> ServeSpec:
    return ServeSpec(role="prefill" if role == "prefill" else "decode", model="tiny", ip=ip,
                     host=host, port=port, side_channel_port=side, block_size=BLOCK,
                     max_model_len=8192, cold_prefill=True, kv_rank=0 if role == "prefill"
                     else 1, kv_parallel_size=2, device="cpu")


def _client(role: str, host: str, port: int, log: Path | None = None) -> EngineClient:
    return EngineClient(Node(role="prefill" if role == "prefill" else "decode", name=role,
                             host=host, port=port, log_path=str(log) if log else None))


@pytest.fixture
def local_node(run_dir: Path) -> Iterator[Callable[[ServeSpec], EngineClient]]:
    """The ``local`` launcher: a node on this host (one host, no fabric)."""
    procs: list[ManagedProcess] = []

    def start(spec: ServeSpec) -> EngineClient:
        cmd = emulator_command(spec, *EMULATOR)
        log = run_dir / f"{spec.role}-{spec.http_port}.log"
        proc = ManagedProcess(spec.role, cmd.argv, log, env={**os.environ, **cmd.env})
        procs.append(proc)
        proc.start()
        url = f"http://{spec.host}:{spec.http_port}"
        wait_http_ok(url + "/health", 60, alive=proc)
        return _client(spec.role, spec.host, spec.http_port, log)

    try:
        yield start
    finally:
        for proc in procs:
            proc.stop()


def _on_read(p: EngineClient, d: EngineClient, counters_of: Callable[[], dict[str, int]],
             seed: str) -> tuple[dict[str, int], float]:
    """Turn 1 through P and D, then turn 2's prefill on P with D's params (a D->P read);
    the counters' deltas around that prefill, and the KV bytes the read had to move."""
    rng = random.Random(seed)
    prompt = [rng.randrange(10, 1000) for _ in range(HISTORY)]
    turn1 = run_pd_turn(p, d, prompt, 8)
    assert turn1.d is not None and turn1.d.ok and turn1.d.params is not None, (turn1.p.error,
                                                                               turn1.d)
    prompt2 = [*turn1.sequence, *[rng.randrange(10, 1000) for _ in range(150)]]
    metrics_before = settled_metrics(p)
    before = counters_of()
    out = p.complete(prompt2, 1, turn1.d.params.for_prefill_hit())
    after = counters_of()
    assert out.ok, out.error
    moved = (settled_metrics(p) - metrics_before).value(NIXL_BYTES)
    pulled = int((settled_metrics(p) - metrics_before).value(
        "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"))
    expected = blocks_for_tokens(pulled, BLOCK) * BLOCK * KV_BYTES_PER_TOKEN
    assert pulled >= HISTORY - BLOCK and moved == expected, (pulled, moved, expected)
    if out.params is not None:
        d.complete(prompt2, 1, out.params)
    return deltas(before, after), expected


def test_d_on_its_host_through_ssh_reads_cross_the_veth(
    two_hosts: TwoHosts, ssh_launch: Callable[..., SshNode],
    local_node: Callable[[ServeSpec], EngineClient], run_dir: Path,
) -> None:
    hosts = two_hosts
    d_spec = _spec("decode", hosts.d_addr, hosts.d_addr, 8200, 5601)
    node = ssh_launch(emulator_command(d_spec, *EMULATOR), name="decode")
    # P's HTTP on its veth address too: D calls back to it (the emulator's claim); this
    # process reaches it through the local route, not across the veth
    p = local_node(_spec("prefill", hosts.p_addr, hosts.p_addr, free_port(hosts.p_addr),
                         free_port(hosts.p_addr)))
    d_url = f"http://{hosts.d_addr}:8200"
    node.wait_healthy(d_url + "/health", 60, log_copy=run_dir / "decode.log")
    d = _client("decode", hosts.d_addr, 8200)
    assert hosts.d_addr in node.where and node.running()

    counters = interface_counters(hosts.p_if)
    delta, expected = _on_read(p, d, lambda: read_counters(counters), "two-hosts")
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
    two_hosts: TwoHosts, local_node: Callable[[ServeSpec], EngineClient],
) -> None:
    """P and D on one host: the read goes over loopback, the veth's counters stay flat,
    and the gate fails naming the interface and its counter."""
    hosts = two_hosts
    lo = "127.0.0.1"
    d = local_node(_spec("decode", lo, lo, free_port(), free_port()))
    p = local_node(_spec("prefill", lo, lo, free_port(), free_port()))
    counters = interface_counters(hosts.p_if)
    delta, expected = _on_read(p, d, lambda: read_counters(counters), "one-host")
    with pytest.raises(FabricFailure) as failure:
        gate_fabric(delta, expected, INTERFACE_OVERHEAD, what=f"P's interface {hosts.p_if}")
    text = str(failure.value)
    assert f"{hosts.p_if} rx_bytes" in text and f"{expected:,}" in text, text


@pytest.mark.parametrize("case", ["refused login", "unreachable host"])
def test_bad_ssh_target_fails_once_in_one_line_and_leaves_nothing(
    two_hosts: TwoHosts, case: str, run_dir: Path,
) -> None:
    hosts = two_hosts
    good = ssh_host(hosts)
    assert hosts.bad_ssh is not None
    target = (good.__class__(hosts.d_addr, user="root", options=hosts.bad_ssh.options)
              if case == "refused login" else good.__class__(hosts.spare_addr, user="root",
                                                             options=good.options))
    before = sorted(hosts.pids_in_d())
    spec = _spec("decode", hosts.d_addr, hosts.d_addr, 8200, 5601)
    remote = run_dir / "remote"
    with pytest.raises(LaunchFailed) as failure:
        SshLauncher(target, run_dir=str(remote)).start(emulator_command(spec, *EMULATOR),
                                                       name="decode")
    text = str(failure.value)
    assert "\n" not in text and text.startswith(f"ssh root@{target.host}: "), text
    cause = "Permission denied" if case == "refused login" else "No route to host"
    assert cause in text, text
    assert sorted(hosts.pids_in_d()) == before
    assert not remote.exists()


_INNER = '''
import threading
from pathlib import Path

from bidir_kv.testing.two_hosts import emulator_command
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
'''


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_ssh_nodes_are_stopped_when_the_test_fails_or_is_interrupted(tmp_path: Path) -> None:
    """A pytest run whose first test fails and whose second is interrupted (SIGINT) still
    stops both nodes through their pidfiles on D's host."""
    out = tmp_path / "out"
    out.mkdir()
    inner = tmp_path / "test_inner.py"
    inner.write_text(textwrap.dedent(_INNER.format(out=str(out))))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "bidir_kv.testing.plugin",
         "-q", "-o", "addopts=", "--basetemp", str(tmp_path / "inner-tmp"), str(inner)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_for(lambda: (out / "interrupted.pid").exists() or proc.poll() is not None, 180,
                 "the inner run's second node")
        assert proc.poll() is None, proc.communicate()[0]
        failing = int((out / "failing.pid").read_text())
        assert _gone(failing), "the failed test's node still runs"
        interrupted = int((out / "interrupted.pid").read_text())
        assert not _gone(interrupted)
        proc.send_signal(signal.SIGINT)
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
    assert _gone(interrupted), f"the interrupted test's node still runs\n{text}"
