"""What Slurm says when it ends a step, as the slurm launcher reads it from srun's
stderr or the step's output (bidir_kv/launch/slurm.py ``slurm_end``)."""

from __future__ import annotations

from bidir_kv.launch.slurm import slurm_end


def test_a_cancelled_step_a_time_limit_and_a_cancelled_job_are_read() -> None:
    assert (
        slurm_end("slurmstepd-d: error: *** STEP 1.1 ON d CANCELLED AT 2026-12-04T07:19:15 ***")
        == "CANCELLED AT 2026-12-04T07:19:15"
    )
    limit = (
        "INFO engine ready\n"
        "slurmstepd: error: *** STEP 7.0 ON node-b CANCELLED AT 2026-12-04T08:00:01 "
        "DUE TO TIME LIMIT ***\nsrun: error: node-b: task 0: Terminated\n"
    )
    assert slurm_end(limit) == "CANCELLED AT 2026-12-04T08:00:01 DUE TO TIME LIMIT"
    assert (
        slurm_end("slurmstepd: error: *** JOB 12 ON node-a CANCELLED AT 2026-12-04T09:00:00 ***")
        == "CANCELLED AT 2026-12-04T09:00:00"
    )


def test_an_ordinary_exit_says_nothing() -> None:
    assert slurm_end("srun: error: d: task 0: Exited with exit code 1\n") is None
    assert slurm_end("") is None
