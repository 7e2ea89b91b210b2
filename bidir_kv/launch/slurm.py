"""The ``slurm`` launcher: P and D as job steps of one allocation of two nodes.

Inside ``salloc -N 2`` / ``sbatch -N 2`` (``SLURM_JOB_ID`` and ``SLURM_JOB_NODELIST``
set), :func:`allocation` lists the nodes (``scontrol show hostnames``) and refuses an
allocation with fewer than two in one line. Outside one, :func:`allocate` asks Slurm for
one (``salloc --no-shell -N 2``); :meth:`SlurmAllocation.release` cancels it again
(``scancel J``) and waits until ``squeue`` no longer lists it. An allocation the
process runs in is never cancelled by it.

:meth:`SlurmLauncher.start` runs one ``srun`` step per role pinned to its node::

    srun --jobid J --nodelist NODE --nodes 1 --ntasks 1 --overlap --job-name bidir-kv-ROLE \\
         --output LOG env K=V ... <argv>

and finds the step's id by its name (``squeue --steps``); :meth:`SlurmStep.stop` cancels
exactly that step (``scancel J.S``), so the allocation and any other step live on. The
step's log is written by Slurm on the node's shared file system and copied back.

**A step Slurm ended** (``scancel`` of the step or the job by someone else, the job's time
limit, a node failure) is reported, not mistaken for a node that never came up or
stopped cleanly: :meth:`SlurmStep.ended` says how it ended, from srun's exit code and
the line Slurm writes to srun's stderr (``*** STEP J.S ON NODE CANCELLED AT ... DUE TO
TIME LIMIT ***``); waiting for the node's ``/health`` ends with it, and :meth:`stop`
of such a step says it had already ended and why.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bidir_kv.launch.remote import Command, LaunchFailed, one_line

__all__ = [
    "SlurmAllocation",
    "SlurmLauncher",
    "SlurmStep",
    "allocate",
    "allocation",
    "slurm_end",
]

# what slurmstepd writes to srun's stderr when Slurm ends a step
_SLURM_END = re.compile(r"\*\*\* (?:STEP|JOB) (?P<what>\S+) ON (?P<node>\S+) (?P<how>.+?) \*\*\*")


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
    """A job's allocation; ``owned``: this process asked for it (:func:`allocate`) and
    releases it."""

    job_id: str
    nodes: tuple[str, ...]
    owned: bool = False

    def release(self, timeout: float = 60.0) -> str:
        """Cancel an allocation this process owns (``scancel J``), and wait until squeue
        no longer lists it; one line saying what happened. A no-op for one it runs in."""
        if not self.owned:
            return f"slurm job {self.job_id}: not ours, left running"
        _run(["scancel", self.job_id], f"cancelling job {self.job_id}")
        deadline = time.monotonic() + timeout
        while self.job_id in _jobs():
            if time.monotonic() > deadline:
                raise LaunchFailed(
                    f"slurm: job {self.job_id} still in squeue {timeout:g} s after scancel"
                )
            time.sleep(0.2)  # a bounded poll of squeue
        return f"slurm job {self.job_id} cancelled"


def slurm_end(text: str) -> str | None:
    """What Slurm said when it ended a step or job (``CANCELLED AT 2026-12-04T07:19:15 DUE
    TO TIME LIMIT``), from ``*** STEP J.S ON NODE ... ***`` in ``text``; None if it says
    nothing."""
    found = _SLURM_END.search(text)
    return found.group("how") if found is not None else None


def _by_signal(code: int) -> bool:
    """Whether srun's exit code says its task was ended by a signal (128 + N)."""
    return code < 0 or code > 128


def _read(path: Path | None, tail: int | None = None) -> str:
    """A file's text (its last ``tail`` bytes), or "" when it cannot be read."""
    try:
        data = path.read_bytes() if path is not None else b""
    except OSError:
        return ""
    return (data[-tail:] if tail else data).decode(errors="replace")


def _jobs() -> list[str]:
    """Ids of the jobs squeue lists (any state but completed)."""
    return _run(["squeue", "--noheader", "--format", "%i"], "listing jobs").split()


def allocate(
    need: int = 2, *, job_name: str = "bidir-kv", time_limit: str | None = None
) -> SlurmAllocation:
    """A new allocation of ``need`` nodes (``salloc --no-shell``), owned by the caller:
    release it with :meth:`SlurmAllocation.release`. ``time_limit`` is salloc's
    ``--time`` (Slurm ends every step at it)."""
    argv = ["salloc", "--no-shell", "--nodes", str(need), "--job-name", job_name]
    if time_limit is not None:
        argv += ["--time", time_limit]
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        raise LaunchFailed("slurm: salloc not found (install Slurm's client commands)") from None
    except subprocess.TimeoutExpired:
        raise LaunchFailed(f"slurm: salloc -N {need}: no allocation in 120 s") from None
    granted = re.search(r"Granted job allocation (\d+)", out.stderr + out.stdout)
    if out.returncode != 0 or granted is None:
        raise LaunchFailed(
            f"slurm: salloc -N {need}: {one_line(out.stderr, f'exit {out.returncode}')}"
        )
    job = granted.group(1)
    nodelist = _run(["squeue", "--jobs", job, "--noheader", "--format", "%N"], "listing nodes")
    nodes = tuple(
        _run(["scontrol", "show", "hostnames", nodelist.strip()], "listing nodes").split()
    )
    alloc = SlurmAllocation(job, nodes, owned=True)
    if len(nodes) < need:
        alloc.release()
        raise LaunchFailed(f"slurm: job {job} was given {len(nodes)} node(s); need {need}")
    return alloc


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
    """One running ``srun`` step (``srun_log``: srun's own stderr, where Slurm says why it
    ended a step)."""

    name: str
    job_id: str
    node: str
    step_id: str | None
    log: Path
    proc: subprocess.Popen[bytes]
    srun_log: Path | None = None
    stopped: str | None = field(default=None, init=False)
    cancelling: bool = field(default=False, init=False)
    words_grace: float = 3.0  # seconds to wait for Slurm's words after srun's exit
    _end: str | None = field(default=None, init=False, repr=False)

    @property
    def where(self) -> str:
        return f"slurm job {self.job_id} step {self.step_id} on {self.node}"

    def fetch_log(self, dest: Path) -> Path:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if self.log.exists() and self.log.resolve() != dest.resolve():
            shutil.copyfile(self.log, dest)
        return dest

    def _srun_says(self) -> str:
        """srun's own stderr."""
        return _read(self.srun_log)

    def ended(self) -> str | None:
        """None while the step runs; else how it ended, in one line: Slurm's own words when
        Slurm ended it (cancelled, time limit, node failure: slurmstepd writes them to the
        step's ``--output`` or srun's stderr), else srun's exit code and last words."""
        code = self.proc.poll()
        if code is None:
            return None
        if self._end is not None:
            return self._end
        srun_err, out_tail = self._srun_says(), _read(self.log, 4096)
        how = slurm_end(srun_err + "\n" + out_tail)
        # srun and slurmstepd write independently: srun may exit ("task 0: Killed")
        # before slurmstepd's "*** STEP ... CANCELLED AT ..." reaches the step's log.
        # A step ended by a signal gets a bounded wait for Slurm's words.
        deadline = time.monotonic() + self.words_grace
        while how is None and _by_signal(code) and time.monotonic() < deadline:
            time.sleep(0.05)  # a bounded poll of two files another process writes
            srun_err, out_tail = self._srun_says(), _read(self.log, 4096)
            how = slurm_end(srun_err + "\n" + out_tail)
        self._end = self._describe(code, how, srun_err, out_tail)
        return self._end

    def _describe(self, code: int, how: str | None, srun_err: str, out_tail: str) -> str:
        if how is not None:
            cause = (
                "its time limit"
                if "TIME LIMIT" in how
                else "us (scancel)"
                if self.cancelling
                else "Slurm (scancel or a limit, not by us)"
            )
            return f"{self.name}: {self.where} ended by {cause}: {how.lower()} (srun exit {code})"
        last = one_line(srun_err, one_line(out_tail, "no message"))
        return f"{self.name}: {self.where} ended: srun exit {code}: {last}"

    def stop(self, timeout: float = 30.0) -> str:
        if self.stopped is not None:
            return self.stopped
        before = self.ended()
        if before is not None:
            self.stopped = f"{before} (had already ended)"
            return self.stopped
        self.cancelling = True
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

    def wait_gone(self, timeout: float = 30.0) -> None:
        """Wait until squeue no longer lists the step (after :meth:`stop`)."""
        if self.step_id is None:
            return
        deadline = time.monotonic() + timeout
        step = f"{self.job_id}.{self.step_id}"
        while step in _run(["squeue", "--steps", "--noheader", "--format", "%i"], "listing"):
            if time.monotonic() > deadline:
                raise LaunchFailed(
                    f"slurm: step {step} still in squeue {timeout:g} s after scancel"
                )
            time.sleep(0.2)  # a bounded poll of squeue


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
        srun_log = self.log_dir / f"{name}.srun.log"
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
            with open(srun_log, "wb") as err_out:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err_out,
                    start_new_session=True,
                )
        except FileNotFoundError:
            raise LaunchFailed("slurm: srun not found") from None
        step = SlurmStep(name, self.alloc.job_id, node, None, log, proc, srun_log)
        deadline = time.monotonic() + self.step_timeout
        while step.step_id is None:
            if proc.poll() is not None:
                err = step._srun_says()
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
