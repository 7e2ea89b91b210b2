"""The slurm launcher against a real Slurm cluster of this machine (``slurm_cluster``:
Debian's munged, slurmctld and two slurmd, nodes ``p`` and ``d``).

P and D (emulated engines, ``bidir-kv engine``) are placed as ``srun`` steps of an
allocation the launcher asks for (``salloc --no-shell -N 2``), serve a two-turn
conversation with a D->P read between the steps, and are cancelled with ``scancel``:
afterwards squeue lists no job and no step, and no process of the cluster's jobs is
left. A step cancelled by someone else is reported by the launcher, and waiting for its
``/health`` ends with that report instead of a timeout.
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

from bidir_kv.client import run_pd_turn
from bidir_kv.launch.process import ProcessFailed, free_port, wait_http_ok
from bidir_kv.launch.remote import LaunchFailed
from bidir_kv.launch.slurm import SlurmLauncher, SlurmStep, allocate, allocation
from bidir_kv.serve.command import ServeCommand
from bidir_kv.testing.engines import kv_config, random_prompt
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.testing.poll import wait_for
from bidir_kv.testing.scenario import evidence
from bidir_kv.testing.slurm import SlurmCluster
from bidir_kv.topology.base import EngineSpec, Node
from bidir_kv.topology.local import engine_argv


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """The cluster, with its ``SLURM_CONF`` for the launcher's commands; every test must
    leave it without a job, a step or a process of a job."""
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    yield slurm_cluster
    assert slurm_cluster.jobs() == [] and slurm_cluster.steps() == [], "left in squeue"
    assert slurm_cluster.leftovers() == {}, "processes of a job left running"


def _engine(role: str) -> tuple[ServeCommand, Node]:
    """``bidir-kv engine`` for ``role`` on loopback, as a command a launcher places."""
    port, side = free_port(), free_port()
    engine_id = f"{role}-slurm-{port}"
    argv = engine_argv(EngineSpec(kv=kv_config(role)), port, engine_id)
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}
    node = Node(role=role, name=role, host="127.0.0.1", port=port, side_channel_port=side)
    return ServeCommand(argv=tuple(argv), env=env), node


def test_p_and_d_as_steps_of_an_allocation_serve_and_leave_nothing(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    alloc = allocate(2, job_name="bidir-kv-test")
    steps: list[SlurmStep] = []
    try:
        assert alloc.owned and sorted(alloc.nodes) == ["d", "p"]
        launcher = SlurmLauncher(alloc, tmp_path / "slurm")
        nodes = []
        for role, host in (("prefill", "p"), ("decode", "d")):
            cmd, node = _engine(role)
            steps.append(launcher.start(cmd, name=role, node=host))
            nodes.append(node)
        for step, node in zip(steps, nodes, strict=True):
            wait_http_ok(node.url + "/health", 60, gone=step.ended)
        listed = slurm.run("squeue", "--steps", "--noheader", "--format", "%i %j %N")
        assert {ln.split()[1]: ln.split()[2] for ln in listed.splitlines()} == {
            "bidir-kv-prefill": "p",
            "bidir-kv-decode": "d",
        }, listed
        # the two steps are the engines: turn 2 reads turn 1's KV from D into P
        p, d = EngineClient(nodes[0]), EngineClient(nodes[1])
        rng = random.Random(7)
        t1 = run_pd_turn(p, d, random_prompt(rng, 400), 120)  # more than P will hold
        assert t1.d is not None and t1.d.ok and t1.d.params is not None
        t2 = run_pd_turn(p, d, [*t1.sequence, *random_prompt(rng, 40)], 16, t1.d.params)
        assert t2.d is not None and t2.d.ok
        assert evidence(t2.p_leg.p).pulled, "P did not read from D across the steps"
    finally:
        said = [step.stop() for step in steps]
        for step in steps:
            step.wait_gone()
        released = alloc.release()
    assert [s.split(": ", 1)[1] for s in said] == [
        f"slurm job {alloc.job_id} step {s.step_id} on {s.node} cancelled" for s in steps
    ]
    assert released == f"slurm job {alloc.job_id} cancelled"


def test_a_step_cancelled_by_slurm_is_reported(slurm: SlurmCluster, tmp_path: Path) -> None:
    """An operator's ``scancel J.S`` (or a time limit): the step's end says so, and a
    wait for the node's ``/health`` ends with it, not at its timeout."""
    alloc = allocate(2, job_name="bidir-kv-test")
    try:
        step = SlurmLauncher(alloc, tmp_path / "slurm").start(
            ServeCommand(argv=("sleep", "600"), env={}), name="decode", node="d"
        )
        assert step.ended() is None
        slurm.run("scancel", f"{alloc.job_id}.{step.step_id}")
        with pytest.raises(ProcessFailed) as err:
            wait_http_ok(f"http://127.0.0.1:{free_port()}/health", 120, gone=step.ended)
        report = str(err.value)
        assert report.startswith(
            f"decode: slurm job {alloc.job_id} step {step.step_id} on d ended by Slurm "
            "(scancel or a limit, not by us): cancelled at "
        ), report
        assert step.stop().endswith("(had already ended)")
        step.wait_gone()
    finally:
        alloc.release()


def test_an_allocation_of_one_node_fails_in_one_line_and_starts_no_step(
    slurm: SlurmCluster,
) -> None:
    out = subprocess.run(
        ["salloc", "--no-shell", "--nodes", "1", "--job-name", "bidir-kv-one"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    job = out.stderr.split("Granted job allocation ")[1].split()[0]
    try:
        nodelist = slurm.run("squeue", "--jobs", job, "--noheader", "--format", "%N").strip()
        with pytest.raises(LaunchFailed) as err:
            allocation({"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": nodelist})
        assert str(err.value) == (
            f"slurm: job {job} has 1 node(s) ({nodelist}); P and D need 2 (salloc -N 2)"
        )
        assert slurm.steps() == []
    finally:
        slurm.run("scancel", job)
        wait_for(lambda: job not in slurm.jobs(), 60, "the job to leave squeue", interval=0.2)
