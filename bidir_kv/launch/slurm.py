"""The ``slurm`` launcher: P and D as job steps of one allocation of two nodes.

Inside ``salloc -N 2`` / ``sbatch -N 2`` (``SLURM_JOB_ID`` and ``SLURM_JOB_NODELIST``
set), :func:`allocation` lists the nodes (``scontrol show hostnames``) and refuses an
allocation with fewer than two in one line. :meth:`SlurmLauncher.start` runs one
``srun`` step per role pinned to its node::

    srun --jobid J --nodelist NODE --nodes 1 --ntasks 1 --overlap --job-name bidir-kv-ROLE \\
         --output LOG env K=V ... <argv>

and finds the step's id by its name (``squeue --steps``); :meth:`SlurmStep.stop` cancels
exactly that step (``scancel J.S``), so the allocation and any other step live on. The
step's log is written by Slurm on the node's shared file system and copied back.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bidir_kv.launch.remote import Command, LaunchFailed, one_line

__all__ = ["SlurmAllocation", "SlurmLauncher", "SlurmStep", "allocation"]


def _run(argv: list[str], what: str, timeout: float = 60.0) -> str:
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        raise LaunchFailed(
            f"slurm: {argv[0]} not found; the slurm launcher runs inside a Slurm allocation"
        ) from None
    except subprocess.TimeoutExpired:
        raise LaunchFailed(f"slurm: {what}: no answer from {argv[0]} in {timeout:g} s") from None
    if out.returncode != 0:
        raise LaunchFailed(f"slurm: {what}: {one_line(out.stderr, f'exit {out.returncode}')}")
    return out.stdout


@dataclass(frozen=True)
class SlurmAllocation:
    job_id: str
    nodes: tuple[str, ...]


def allocation(env: Mapping[str, str] | None = None, need: int = 2) -> SlurmAllocation:
    """The allocation this process runs in, with at least ``need`` nodes."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job or not nodelist:
        raise LaunchFailed(
            "slurm: not inside an allocation (SLURM_JOB_ID / SLURM_JOB_NODELIST "
            f"unset); run under salloc -N {need} or sbatch -N {need}"
        )
    nodes = tuple(_run(["scontrol", "show", "hostnames", nodelist], "listing nodes").split())
    if len(nodes) < need:
        raise LaunchFailed(
            f"slurm: job {job} has {len(nodes)} node(s) ({', '.join(nodes)}); "
            f"P and D need {need} (salloc -N {need})"
        )
    return SlurmAllocation(job, nodes)


@dataclass
class SlurmStep:
    """One running ``srun`` step."""

    name: str
    job_id: str
    node: str
    step_id: str | None
    log: Path
    proc: subprocess.Popen[bytes]
    stopped: str | None = field(default=None, init=False)

    @property
    def where(self) -> str:
        return f"slurm job {self.job_id} step {self.step_id} on {self.node}"

    def fetch_log(self, dest: Path) -> Path:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if self.log.exists() and self.log.resolve() != dest.resolve():
            shutil.copyfile(self.log, dest)
        return dest

    def stop(self, timeout: float = 30.0) -> str:
        if self.stopped is not None:
            return self.stopped
        if self.step_id is not None:
            subprocess.run(
                ["scancel", f"{self.job_id}.{self.step_id}"], capture_output=True, timeout=60
            )
        try:
            self.proc.wait(timeout)
            how = "cancelled"
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            how = "killed srun"
        self.stopped = f"{self.name}: {self.where} {how}"
        return self.stopped


@dataclass(frozen=True)
class SlurmLauncher:
    alloc: SlurmAllocation
    log_dir: Path
    step_timeout: float = 60.0  # seconds for the step to show in squeue

    def start(self, cmd: Command, *, name: str, node: str) -> SlurmStep:
        if node not in self.alloc.nodes:
            raise LaunchFailed(
                f"slurm: node {node} is not in job {self.alloc.job_id} "
                f"({', '.join(self.alloc.nodes)})"
            )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        job_name = f"bidir-kv-{name}"
        argv = [
            "srun",
            "--jobid",
            self.alloc.job_id,
            "--nodelist",
            node,
            "--nodes",
            "1",
            "--ntasks",
            "1",
            "--overlap",
            "--job-name",
            job_name,
            "--output",
            str(log),
            "env",
            *(f"{k}={v}" for k, v in cmd.env.items()),
            *cmd.argv,
        ]
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except FileNotFoundError:
            raise LaunchFailed("slurm: srun not found") from None
        step = SlurmStep(name, self.alloc.job_id, node, None, log, proc)
        deadline = time.monotonic() + self.step_timeout
        while step.step_id is None:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise LaunchFailed(
                    f"slurm: srun {name} on {node} exited with {proc.returncode}: "
                    f"{one_line(err, shlex.join(argv[:12]))}"
                )
            listing = _run(
                [
                    "squeue",
                    "--steps",
                    "--jobs",
                    self.alloc.job_id,
                    "--noheader",
                    "--format",
                    "%i %j",
                ],
                "listing steps",
            )
            for line in listing.splitlines():
                sid, _, sname = line.strip().partition(" ")
                if sname == job_name:
                    step.step_id = sid.rpartition(".")[2]
            if step.step_id is None:
                if time.monotonic() > deadline:
                    step.stop(10)
                    raise LaunchFailed(
                        f"slurm: step {job_name} of job {self.alloc.job_id} "
                        f"did not appear in squeue in {self.step_timeout:g} s"
                    )
                time.sleep(0.5)  # a bounded poll of squeue
        return step
