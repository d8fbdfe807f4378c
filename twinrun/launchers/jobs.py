"""The submitit job: one process that measures one run (or some of its units), requeued on USR2."""

import os
import socket
import sys
from pathlib import Path

import submitit

from twinrun.errors import TwinrunError
from twinrun.job import run_job
from twinrun.storage.rundir import RunIndex


class PairJob(submitit.helpers.Checkpointable):
    """The job: measure every pending (arm, unit) of one planned run directory, or of its `units` only
    (one array element of launcher.split=bins).

    Its only state is the run directory. On USR2 submitit calls `checkpoint`, which requeues this
    same object; the next start runs `run_job` again, which skips every unit whose arms' stores all
    exist and verify (a half-measured unit is measured again, whole), so no finished unit is recomputed.
    """

    def __init__(self, run_dir: str | Path, trusted=(), units: list[int] | None = None,
                 gpus: int | None = None):
        self.run_dir = str(Path(run_dir).resolve())
        self.trusted = list(trusted)  # builders the submitting user composed or named (plan.load_arms)
        self.units = None if units is None else list(units)
        self.gpus = gpus  # GPUs the launcher requested for this job: `auto` resolves against it

    def __call__(self) -> str:
        run_dir, units = Path(self.run_dir), self.units
        which = "" if units is None else f" (units {', '.join(map(str, units))})"
        print(f"twinrun: {where()}: {run_dir}{which}; {units_done(run_dir)}", flush=True)
        try:
            # (A job pickled by an earlier twinrun, requeued across an upgrade, has no `gpus`.)
            return run_job(run_dir, self.trusted, units, getattr(self, "gpus", None))["status"]
        except TwinrunError as err:
            # One readable line before submitit's traceback; re-raised, so the job ends FAILED.
            print(f"twinrun: error: {err}", file=sys.stderr, flush=True)
            raise

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        print(f"twinrun: signalled ({where()}): {units_done(Path(self.run_dir))}; requeueing, "
              "the next start resumes from them", flush=True)
        return super().checkpoint(*args, **kwargs)


def where() -> str:
    """This process's allocation, for the job's log."""
    env = os.environ
    job = env.get("SLURM_JOB_ID") or env.get("SUBMITIT_LOCAL_JOB_ID") or "-"
    task = env.get("SLURM_ARRAY_TASK_ID")
    restart = env.get("SLURM_RESTART_COUNT", "0")
    return (f"job {job}{f' array task {task}' if task else ''} start {int(restart) + 1} "
            f"on {socket.gethostname()} pid {os.getpid()}")


def units_done(run_dir: Path) -> str:
    """Which units are already whole (every arm's store done), as run.json says."""
    index = RunIndex.load(run_dir)
    whole = [u["index"] for u in index.whole_units()]
    if not whole:
        return f"0/{len(index.units)} units done"
    return f"{len(whole)}/{len(index.units)} units done (skipped on resume: {', '.join(map(str, whole))})"
