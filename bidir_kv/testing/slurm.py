"""A real Slurm cluster on this machine for the slurm launcher's tier (``slurm_cluster``).

Debian's ``munged``, ``slurmctld`` and two ``slurmd`` (``ci/provision.d/slurm.sh``
installs them), each started in the foreground by the fixture with its own
configuration, MUNGE key and socket, spool, state and log files and its own ports, on
loopback: nodes ``p`` and ``d`` are two ``slurmd -N NAME`` of this host. Nothing of the
system's (``/etc/slurm``, ``/etc/munge``, ``/run/munge``) is read or written.

Every daemon, and every process Slurm starts for a job, carries the cluster's
``SLURM_CONF`` in its environment: :meth:`SlurmCluster.leftovers` finds by it what
outlived a test. At teardown every job is cancelled (``scancel``), the daemons are
stopped, and a process still carrying the variable fails the test.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bidir_kv.launch.process import ManagedProcess, ProcessFailed, free_port, process_tree
from bidir_kv.testing.gating import skip_or_fail
from bidir_kv.testing.poll import wait_for

__all__ = ["PROVISION", "SlurmCluster", "slurm_cluster", "unavailable_reason"]

PROVISION = "ci/provision.d/slurm.sh"
NODES = ("p", "d")
_TOOLS = (
    "munged",
    "slurmctld",
    "slurmd",
    "salloc",
    "srun",
    "squeue",
    "scancel",
    "scontrol",
    "sinfo",
)


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    if os.geteuid() != 0:
        return "a Slurm cluster of this machine needs root (slurmd runs the steps' processes)"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed ({PROVISION}: Debian's slurm-wlm and munge)"
    return None


def _conf(root: Path, ctld_port: int, node_ports: dict[str, int]) -> str:
    lines = [
        "ClusterName=bidirkv",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge' / 'munge.socket'}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}/%n",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
        # no cgroups, no accounting database: a container's view of one machine
        "ProctrackType=proctrack/pgid",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        # the job's time limit is checked every 5 s, not every 30 (Slurm's default)
        "InactiveLimit=0",
        "KillWait=5",
        "MessageTimeout=10",
        *(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=2 "
            "State=UNKNOWN"
            for n, port in node_ports.items()
        ),
        f"PartitionName=test Nodes={','.join(node_ports)} Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


@dataclass
class SlurmCluster:
    """The running cluster: its ``slurm.conf``, node names and daemons."""

    root: Path
    conf: Path
    nodes: tuple[str, ...] = NODES
    daemons: list[ManagedProcess] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """What a client command (salloc, srun, squeue) needs in its environment."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 60.0) -> str:
        """A Slurm command against this cluster; its stdout (a failure raises with stderr)."""
        out = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.env},
            stdin=subprocess.DEVNULL,
        )
        if out.returncode != 0:
            raise ProcessFailed(f"{' '.join(argv)}: exit {out.returncode}: {out.stderr.strip()}")
        return out.stdout

    def jobs(self) -> list[str]:
        """Ids of the jobs squeue lists."""
        return self.run("squeue", "--noheader", "--format", "%i").split()

    def steps(self) -> list[str]:
        """Ids (``J.S``) of the steps squeue lists."""
        return self.run("squeue", "--steps", "--noheader", "--format", "%i").split()

    def leftovers(self) -> dict[int, str]:
        """Processes other than the daemons that carry this cluster's ``SLURM_CONF``:
        slurmstepd and the steps' tasks (pid -> command line). slurmctld's helper
        (slurmscriptd) is the daemon's own; every job process hangs off a slurmd."""
        ours = {p.pid for p in self.daemons}
        for daemon in self.daemons:
            if daemon.name in ("slurmctld", "munged") and daemon.pid is not None:
                ours |= set(process_tree(daemon.pid))
        mark = f"SLURM_CONF={self.conf}".encode()
        found: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if (
                not entry.name.isdigit()
                or int(entry.name) in ours
                or int(entry.name) == os.getpid()
            ):
                continue
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    cmd = (
                        (entry / "cmdline")
                        .read_bytes()
                        .replace(b"\0", b" ")
                        .decode(errors="replace")
                    )
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        found[int(entry.name)] = cmd.strip()
            except OSError:
                continue
        return found

    def idle(self) -> bool:
        states = self.run("sinfo", "--noheader", "--Node", "--format", "%N %t").split("\n")
        seen = dict(line.split() for line in states if line.strip())
        return all(seen.get(n) == "idle" for n in self.nodes)

    def cancel_everything(self, timeout: float = 60.0) -> None:
        """``scancel`` every job, and wait until squeue lists none."""
        for job in self.jobs():
            self.run("scancel", job)
        wait_for(lambda: not self.jobs(), timeout, "squeue to list no job", interval=0.2)

    def stop(self) -> None:
        for daemon in reversed(self.daemons):
            daemon.stop(20)


def _start(root: Path) -> SlurmCluster:
    for sub in ("munge", "munge-key", "state", "log", *(f"spool/{n}" for n in NODES)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    # munged refuses a key others may read and a socket directory others cannot enter
    os.chmod(root, 0o755)
    os.chmod(root / "munge", 0o755)
    os.chmod(root / "munge-key", 0o700)
    key = root / "munge-key" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    os.chmod(key, 0o600)
    conf = root / "slurm.conf"
    ports = {n: free_port() for n in NODES}
    conf.write_text(_conf(root, free_port(), ports))
    cluster = SlurmCluster(root, conf)
    env = {**os.environ, **cluster.env}
    socket = root / "munge" / "munge.socket"
    log = root / "log"
    munged = ManagedProcess(
        "munged",
        [
            "munged",
            "--foreground",
            f"--socket={socket}",
            f"--key-file={key}",
            f"--pid-file={root / 'munge-key' / 'munged.pid'}",
            f"--log-file={root / 'munge-key' / 'munged.log'}",
            f"--seed-file={root / 'munge-key' / 'munged.seed'}",
        ],
        log / "munged.out",
        env=env,
    )
    cluster.daemons.append(munged.start())
    try:
        wait_for(socket.exists, 30, "munged's socket", interval=0.05)
        ctld = ManagedProcess(
            "slurmctld", ["slurmctld", "-D", "-i", "-f", str(conf)], log / "slurmctld.out", env=env
        )
        cluster.daemons.append(ctld.start())
        for node in NODES:
            slurmd = ManagedProcess(
                f"slurmd-{node}",
                ["slurmd", "-D", "-f", str(conf), "-N", node],
                log / f"slurmd-{node}.out",
                env=env,
            )
            cluster.daemons.append(slurmd.start())
        deadline = time.monotonic() + 60
        while True:
            dead = [d for d in cluster.daemons if d.returncode is not None]
            if dead:
                raise ProcessFailed(f"{dead[0].name} exited: {dead[0].log_tail()}")
            try:
                if cluster.idle():
                    return cluster
            except ProcessFailed:
                pass  # slurmctld not answering yet
            if time.monotonic() > deadline:
                raise ProcessFailed(
                    f"Slurm nodes {NODES} not idle in 60 s: {cluster.daemons[-1].log_tail()}"
                )
            time.sleep(0.2)  # a bounded poll of sinfo
    except BaseException:
        cluster.stop()
        raise


@pytest.fixture(scope="module")
def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[SlurmCluster]:
    """A two-node Slurm cluster of this machine, torn down after the module; a job, a
    step or a process left behind by the module fails its teardown."""
    reason = unavailable_reason()
    if reason:
        skip_or_fail(request.config, "integration", f"no Slurm here: {reason}")
    root = Path(tempfile.mkdtemp(prefix="bidir-kv-slurm-"))
    try:
        cluster = _start(root)
    except ProcessFailed as exc:
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(f"the Slurm cluster did not start: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        left = {}
        try:
            left = {"jobs": cluster.jobs(), "steps": cluster.steps()}
            cluster.cancel_everything()
        finally:
            cluster.stop()
            stray = cluster.leftovers()
            for pid in stray:
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
            shutil.rmtree(root, ignore_errors=True)
        if any(left.values()) or stray:
            pytest.fail(f"left behind by the Slurm tests: {left}, processes {stray}", pytrace=False)
