"""``--hw-launch``: the hardware tier starts P and D with ``bidir-kv serve``'s command.

``--hw-launcher`` places them (docs/hardware.md §3):

* ``local`` (default): both on this runner with their own accelerator sets
  (``--hw-p-gpus``, ``--hw-d-gpus``), HTTP ports 8100/8200 and side-channel ports
  5600/5601 (one host needs two); stopped through their pidfiles. One host, no fabric:
  the reads never touch a NIC, and the report says so.
* ``ssh``: P on ``P_HOST`` and D on ``D_HOST`` of ``--hw-hosts`` through the ssh launcher
  (each node its host's accelerators, the recipe's ports), logs fetched back into the
  report directory, stopped by pidfile on each host; the fabric gate reads P's EFA
  counters on P's host through ssh.
* ``slurm``: one ``srun`` step per role pinned to its node of an allocation of two
  nodes: the one the tier runs in (``salloc``/``sbatch``), else one it asks for
  (``salloc --no-shell -N 2``) and cancels after; the steps are cancelled after the tier
  (``scancel``), a step Slurm ended (time limit, scancel) ends the wait for its node
  with the launcher's report; the counters are read on P's node through ssh.
* ``kubernetes``: P and D as pods on two nodes (``bidir-kv serve --emit kubernetes``'s
  manifests) created and deleted through the API (``--hw-kube-api``, ``--hw-image``);
  no fabric probe (the counters live on the node, outside the tier's reach).

Every node is stopped when the tier's module ends, even when it fails.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bidir_kv.fabric.probe import FabricProbe
from bidir_kv.launch.pidfile import launch, stop
from bidir_kv.launch.process import wait_http_ok
from bidir_kv.launch.ssh import SshHost, SshLauncher
from bidir_kv.policy import peer_entries
from bidir_kv.serve.command import ServeSpec, build
from bidir_kv.testing.hw_options import HwOptions
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.topology.base import Node

__all__ = ["launch_pair"]


def _spec(opts: HwOptions, role: str, model: str) -> ServeSpec:
    return ServeSpec(
        role="prefill" if role == "prefill" else "decode",
        model=model,
        cold_prefill=True,
        host="127.0.0.1",
        ip="127.0.0.1",
        side_channel_port=5600 if role == "prefill" else 5601,
        tp=opts.tp,
        nixl_backend=opts.nixl_backend,
        device=opts.device,
        kv_rank=0 if role == "prefill" else 1,
        kv_parallel_size=2,
        kv_recompute_threshold=opts.threshold,
        visible=opts.p_gpus if role == "prefill" else opts.d_gpus,
        extra_args=opts.launch_arg,
    )


def _paired(specs: list[ServeSpec], hosts_known: bool) -> list[ServeSpec]:
    """P and D each with the other as its peer allowlist, as ``bidir-kv serve`` lists it:
    by address where the host is one, else by engine id (Kubernetes: pod IPs unknown)."""
    return [
        replace(s, peer_allowlist=peer_entries([(other.engine, other.ip if hosts_known else None)]))
        for s, other in zip(specs, reversed(specs), strict=True)
    ]


def _host_ip(host: str) -> str:
    return host.rpartition("@")[2]


def _remote_pair(
    opts: HwOptions, run_dir: Path, model: str, launcher: str
) -> tuple[EngineClient, EngineClient, dict[str, Any], Callable[[], None], FabricProbe | None]:
    """P and D on two hosts through the ssh, slurm or kubernetes launcher."""
    from bidir_kv.fabric.probe import remote_probe
    from bidir_kv.launch.remote import NodeHandle

    hosts: list[str]
    releases: list[Callable[[], object]] = []  # an allocation the tier asked for
    if launcher == "slurm":
        from bidir_kv.launch.slurm import SlurmLauncher, allocate, allocation

        alloc = allocation() if os.environ.get("SLURM_JOB_ID") else allocate(2)
        releases.append(alloc.release)
        hosts = list(alloc.nodes[:2])
    elif launcher == "kubernetes":
        hosts = []
    else:
        assert opts.hosts is not None  # HwOptions.check: ssh needs them
        hosts = list(opts.hosts)
    specs = _paired(
        [
            replace(
                _spec(opts, role, model),
                host="0.0.0.0",
                side_channel_port=5600,
                ip=_host_ip(hosts[i]) if hosts else "127.0.0.1",
                visible=None,
            )
            for i, role in enumerate(("prefill", "decode"))
        ],
        bool(hosts),
    )
    handles: list[NodeHandle] = []
    urls: list[str] = []

    def close() -> None:
        for h in reversed(handles):
            with contextlib.suppress(Exception):
                h.fetch_log(run_dir / f"{h.name}.log")
            with contextlib.suppress(Exception):
                h.stop(60)
        for release in releases:  # the allocation's own, after its steps (slurm)
            with contextlib.suppress(Exception):
                release()

    options = opts.ssh_option
    try:
        if launcher == "kubernetes":
            from bidir_kv.launch.kubernetes import KubeApi, KubeLauncher
            from bidir_kv.serve.kubernetes import KubeOptions, manifests

            kopts = KubeOptions(image=opts.image, namespace=opts.kube_namespace)
            kube = KubeLauncher(KubeApi(opts.kube_api))
            docs = manifests(specs, kopts)
            for spec, pair in zip(specs, (docs[:2], docs[2:]), strict=True):
                handles.append(kube.start(pair))
                urls.append(
                    f"http://{kopts.name}-{spec.role}.{kopts.namespace}.svc:{spec.http_port}"
                )
        for i, spec in enumerate(specs if launcher != "kubernetes" else []):
            host = hosts[i]
            if launcher == "slurm":
                handles.append(
                    SlurmLauncher(alloc, run_dir / "slurm").start(
                        build(spec), name=spec.role, node=host
                    )
                )
            else:
                node = SshLauncher(
                    SshHost(_host_ip(host), user=host.rpartition("@")[0] or None, options=options),
                    run_dir="/tmp/bidir-kv-release",
                )
                handles.append(node.start(build(spec), name=spec.role))
            urls.append(f"http://{_host_ip(host)}:{spec.http_port}")
        for url, h in zip(urls, handles, strict=True):
            # a node whose launcher can tell it ended (a Slurm step) ends the wait early
            wait_http_ok(url + "/health", 1800, gone=getattr(h, "ended", None))
    except BaseException:
        close()
        raise
    nodes = [
        Node(role=s.role, name=s.role, host=urlsplit(u).hostname or "", port=s.http_port)
        for s, u in zip(specs, urls, strict=True)
    ]
    served = opts.model or str(model)
    fabric = opts.fabric
    probe = None
    if hosts and fabric != "off":
        p_host = SshHost(
            _host_ip(hosts[0]), user=hosts[0].rpartition("@")[0] or None, options=options
        )
        probe = remote_probe("efa" if fabric == "auto" else fabric, p_host, opts.fabric_overhead)
    desc = {
        "model": model,
        "hosts": hosts or urls,
        "launcher": launcher,
        "nodes": [h.where for h in handles],
    }
    return (
        EngineClient(nodes[0], model=served, timeout=600),
        EngineClient(nodes[1], model=served, timeout=600),
        desc,
        close,
        probe,
    )


def launch_pair(
    opts: HwOptions, run_dir: Path
) -> tuple[EngineClient, EngineClient, dict[str, Any], Callable[[], None], FabricProbe | None]:
    """(P client, D client, description, close, fabric probe) of the started pair."""
    model = str(opts.launch_model)  # HwOptions.check: --hw-launch needs it
    launcher = opts.launcher or "local"
    if launcher != "local":
        return _remote_pair(opts, run_dir, model, launcher)
    specs = _paired([_spec(opts, role, model) for role in ("prefill", "decode")], True)
    pidfiles = [run_dir / f"{s.role}-{s.http_port}.pid" for s in specs]

    def close() -> None:
        for pidfile in pidfiles:
            with contextlib.suppress(OSError, ValueError):
                stop(pidfile, timeout=60)

    try:
        records = [
            launch(
                build(s),
                role=s.role,
                url=f"http://127.0.0.1:{s.http_port}",
                log_path=run_dir / f"{s.role}-{s.http_port}.log",
                pidfile=pf,
                health_timeout=1800,
                wait=False,
            )
            for s, pf in zip(specs, pidfiles, strict=True)
        ]
        for rec in records:
            wait_http_ok(rec.url + "/health", 1800)
    except BaseException:
        close()
        raise
    nodes = [
        Node(role=s.role, name=s.role, host="127.0.0.1", port=s.http_port, log_path=r.log)
        for s, r in zip(specs, records, strict=True)
    ]
    served = opts.model or model
    return (
        EngineClient(nodes[0], model=served, timeout=600),
        EngineClient(nodes[1], model=served, timeout=600),
        {
            "model": model,
            "commands": [list(r.argv) for r in records],
            "launcher": "local",
            "hosts": ["127.0.0.1"],
        },
        close,
        None,
    )
