"""The submitit jobs: one process that measures one run (or some of its units), or a pack of runs, one
process each on one node (launcher.pack); requeued on USR2, resumed from the finished units.

`python -m twinrun.launchers.jobs RUN_DIR [TRUSTED…]` is one process of a pack: the pair job of one run.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import submitit

from twinrun.errors import EXIT_OK, Interrupted, TwinrunError, raise_on_signals, signal_first
from twinrun.job import run_job
from twinrun.storage.rundir import RunIndex

CHILD_STOP_S = 60  # after USR2, how long a pack's processes get to record their units and exit
CHILD_POLL_S = 0.2


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


def assign_devices(n_runs: int, visible: str | None) -> list[str]:
    """Each run's CUDA_VISIBLE_DEVICES: one of the GPUs the job was given (SLURM's CUDA_VISIBLE_DEVICES),
    in turn; "" (no GPU) for every run when the job has none, so no process lands on a GPU by accident.
    With fewer GPUs than runs the runs take turns (PackedJob runs one process per GPU at a time)."""
    gpus = [g.strip() for g in (visible or "").split(",") if g.strip() and g.strip() != "-1"]
    return [gpus[i % len(gpus)] if gpus else "" for i in range(n_runs)]


class PackedJob(submitit.helpers.Checkpointable):
    """The job of launcher.pack: several whole runs on one node, one process per run (each run's pair
    still one process, its units back to back), at most one process per GPU at a time.

    Each process is `python -m twinrun.launchers.jobs RUN_DIR`, so each fingerprints itself into its own
    run (its GPU among them). On USR2 every process is stopped (SIGTERM: its finished units are kept)
    and the pack requeues whole; the next start runs every process again, each resuming its run from its
    finished units. A run that fails is its own run.json's failure: the others go on.
    """

    def __init__(self, run_dirs: list, trusted=(), cpus_per_run: int | None = None):
        self.run_dirs = [str(Path(r).resolve()) for r in run_dirs]
        self.trusted = list(trusted)
        self.cpus_per_run = cpus_per_run  # launcher.cpus_per_task: each process's threads (None: torch's)
        self._children: dict[str, subprocess.Popen] = {}

    def __getstate__(self) -> dict:  # requeued by pickling: the running processes stay behind
        return {"run_dirs": self.run_dirs, "trusted": self.trusted, "cpus_per_run": self.cpus_per_run}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({"cpus_per_run": None, **state}, _children={})

    def __call__(self) -> dict[str, int]:
        devices = assign_devices(len(self.run_dirs), os.environ.get("CUDA_VISIBLE_DEVICES"))
        slots = len(set(devices) - {""}) or len(devices)
        print(f"twinrun: {where()}: a pack of {len(self.run_dirs)} runs, one process each "
              f"({'GPUs ' + ', '.join(devices) if any(devices) else 'no GPU'})", flush=True)
        queue, codes = list(zip(self.run_dirs, devices)), {}
        while queue or self._children:
            busy = {devices[self.run_dirs.index(r)] for r in self._children}
            for run_dir, device in list(queue):
                if len(self._children) < slots and (device == "" or device not in busy):
                    queue.remove((run_dir, device))
                    self._children[run_dir] = self._start(run_dir, device)
                    busy.add(device)
            for run_dir, child in list(self._children.items()):
                if child.poll() is not None:
                    codes[run_dir] = child.returncode
                    del self._children[run_dir]
            time.sleep(CHILD_POLL_S)
        print(f"twinrun: pack done: {', '.join(f'{Path(r).name} exit {c}' for r, c in codes.items())}",
              flush=True)
        return codes

    def _start(self, run_dir: str, device: str) -> subprocess.Popen:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": device}
        if self.cpus_per_run:  # the job holds pack × cpus_per_task CPUs: each process uses its own share
            env["OMP_NUM_THREADS"] = str(self.cpus_per_run)
        return subprocess.Popen([sys.executable, "-m", "twinrun.launchers.jobs", run_dir, *self.trusted],
                                env=env)

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        running = list(self._children.items())
        print(f"twinrun: signalled ({where()}): stopping {len(running)} process(es) of the pack; requeueing "
              "it whole, each run resumes from its finished units", flush=True)
        for _, child in running:
            child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + CHILD_STOP_S
        for _, child in running:
            try:
                child.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                child.kill()
        self._children = {}
        return super().checkpoint(*args, **kwargs)


def main(argv: list[str]) -> int:
    """One process of a pack: the pair job of one run; its exit code is the run's (0, or the error's)."""
    raise_on_signals()
    # SLURM signals every process of the step: the pack's own process answers USR2 (it stops this one
    # with SIGTERM, then requeues the pack); here USR2's default would end the run unrecorded.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    run_dir, trusted = argv[0], argv[1:]
    try:
        with signal_first():
            PairJob(run_dir, trusted)()
    except TwinrunError as err:  # PairJob printed its line; run.json records the failure
        return err.exit_code
    except Interrupted as err:  # the pack stopped it (SIGTERM): run.json says interrupted, the pack requeues
        return err.exit_code
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
