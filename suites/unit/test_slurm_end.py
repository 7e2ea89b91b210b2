"""What Slurm says when it ends a step, as the slurm launcher reads it from srun's
stderr or the step's output (bidir_kv/launch/slurm.py ``slurm_end``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bidir_kv.launch.slurm import SlurmStep, slurm_end


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


class _LateWords(SlurmStep):
    """A step whose srun exited before slurmstepd's words reached srun's stderr: the words
    show from the third read on (as when slurmstepd writes after srun's exit)."""

    reads = 0

    def _srun_says(self) -> str:
        self.reads += 1
        if self.reads < 3:
            return "srun: error: d: task 0: Killed\n"
        return (
            "srun: error: d: task 0: Killed\n"
            "slurmstepd: error: *** STEP 2.0 ON d CANCELLED AT 2026-12-04T09:00:00 ***\n"
        )


def _exited(code: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    proc.wait()
    return proc


def _step(cls: type[SlurmStep], code: int, tmp_path: Path) -> SlurmStep:
    return cls("decode", "2", "d", "0", tmp_path / "decode.log", _exited(code))


def test_slurms_words_written_after_sruns_exit_are_waited_for(tmp_path: Path) -> None:
    step = _step(_LateWords, 137, tmp_path)
    assert step.ended() == (
        "decode: slurm job 2 step 0 on d ended by Slurm (scancel or a limit, not by us): "
        "cancelled at 2026-12-04t09:00:00 (srun exit 137)"
    )
    assert step.ended() == step.ended()  # read once, then kept


def test_an_ordinary_failure_is_reported_without_waiting_for_slurm(tmp_path: Path) -> None:
    step = _step(_LateWords, 1, tmp_path)
    assert step.ended() == (
        "decode: slurm job 2 step 0 on d ended: srun exit 1: srun: error: d: task 0: Killed"
    )
