"""Waiting on submitted jobs: progress from each run directory, state from the scheduler, and a failed
job's exit code and log tail, named by run and unit."""

import sys
import time
from pathlib import Path
from typing import NamedTuple

import submitit
from submitit.core.utils import UncompletedJobError

from twinrun.errors import EXIT_GATE, EXIT_MODEL, EXIT_REFUSED, EXIT_USAGE, FAILURE_EXIT_CODES
from twinrun.launchers.placement import Element
from twinrun.launchers.record import describe, progress
from twinrun.launchers.slurm import (
    GONE,
    SLURM_ENDED,
    UNRESOLVABLE,
    UNRESOLVABLE_GRACE_S,
    sacct_state,
    slurm_states,
)
from twinrun.storage.rundir import RunIndex

TAIL_LINES = 8
FINAL_STATE_WAIT_S = 15  # how long a failed job may take to leave the queue, for its final state


class Submitted(NamedTuple):
    """One submitted job: the run directory it measures, its units (None: every pending unit), the job."""

    run_dir: Path
    units: list[int] | None
    job: object


def wait(submitted: list[tuple[Element, object]], launcher: dict) -> dict[Path, int]:
    """Block until every job has ended, printing state and units done as they change.

    Returns {run_dir: exit code} for the runs with a failed job (the worst of its elements; 1: an arm
    failed, run.json names it; 4: the model raised; 2: the job died or failed otherwise), after
    printing the error's tail, named by run and unit; the rest measured.
    """
    pending = {k: Submitted(e.run_dir, e.units, job) for k, (e, job) in enumerate(submitted)}
    runs = {k: e.run_dir for k, e in pending.items()}
    states: dict[int, str] = {}  # every job's latest state, ended ones included: a run's line counts them all
    shown: dict[Path, str] = {}
    failed: dict[Path, int] = {}
    stuck_since: dict[int, float] = {}
    try:
        while pending:
            for key, (ended, state) in _poll({k: e.job for k, e in pending.items()}).items():
                e = pending[key]
                states[key] = state
                if _stuck(key, state, stuck_since):
                    pending.pop(key)
                    _fail(failed, e.run_dir, _cancel_stuck(_label(e), e.job, state))
                    continue
                if ended:
                    code = _outcome(pending.pop(key), state)
                    if code is not None:
                        _fail(failed, e.run_dir, code)
            for run_dir in dict.fromkeys(runs.values()):  # one line per run, printed when it changes
                own = [states[k] for k, r in runs.items() if r == run_dir and k in states]
                line = describe(run_dir, progress(RunIndex.load(run_dir)), _states_text(own))
                if shown.get(run_dir) != line:
                    print(f"twinrun: {line}", flush=True)
                    shown[run_dir] = line
            if pending:
                time.sleep(launcher["poll_s"])
    except KeyboardInterrupt:
        where = " ".join(str(r) for r in dict.fromkeys(e.run_dir for e in pending.values()))
        print(f"\ntwinrun: stopped waiting; the jobs keep running. Follow them with "
              f"`python -m twinrun.status {where}`, then reduce with `python -m twinrun.reduce RUN_DIR`",
              file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    return failed


def _states_text(states: list[str]) -> str | None:
    """One job's state, or a run's several (split=bins) counted: "RUNNING", "2 RUNNING, 4 PENDING"."""
    if len(states) <= 1:
        return states[0] if states else None
    counts = {}
    for state in states:
        counts[state.split()[0]] = counts.get(state.split()[0], 0) + 1
    return ", ".join(f"{n} {state}" for state, n in counts.items())


def _fail(failed: dict, run_dir: Path, code: int) -> None:
    failed[run_dir] = max(code, failed.get(run_dir, code))


def _label(e: "Submitted") -> str:
    return str(e.run_dir) if e.units is None else f"{e.run_dir} unit {', '.join(map(str, e.units))}"


def _stuck(key, state: str, since: dict) -> bool:
    """Pending, for longer than the grace, for a reason no amount of waiting resolves."""
    reason = state.partition("(")[2].rstrip(")").split(",")[0].strip() if state.startswith("PENDING") else ""
    if reason not in UNRESOLVABLE:
        since.pop(key, None)
        return False
    return time.monotonic() - since.setdefault(key, time.monotonic()) > UNRESOLVABLE_GRACE_S


def _cancel_stuck(label: str, job, state: str) -> int:
    reason = state.partition("(")[2].rstrip(")").split(",")[0].strip()
    job.cancel(check=False)
    knobs = "launcher." + UNRESOLVABLE[reason].replace(", ", ", launcher.").replace(" or ", " or launcher.")
    print(f"twinrun: error: {label}: job {job.job_id} cancelled: it was {state}, which waiting cannot "
          f"resolve; change {knobs} to fit the partition and resume", file=sys.stderr, flush=True)
    return EXIT_USAGE


def _poll(pending: dict) -> dict:
    """{key: (ended, state)} of {key: job}: squeue first (one call, needs no accounting), sacct if mute."""
    jobs = list(pending.values())
    slurm = [j for j in jobs if isinstance(j, submitit.SlurmJob)]
    queue = slurm_states([j.job_id for j in slurm]) if slurm else None
    if slurm and queue is None:
        slurm[0].get_info(mode="force")  # one forced sacct updates submitit's shared watcher for all
    out = {}
    for key, job in pending.items():
        finished = job.paths.result_pickle.exists()
        if not isinstance(job, submitit.SlurmJob):
            out[key] = (finished or job.done(), job.state)
        elif queue is not None:
            state = queue[job.job_id]
            out[key] = (finished or state in SLURM_ENDED or state == GONE, state)
        else:
            state = (job.get_info(mode="cache").get("State") or "UNKNOWN").split()[0]
            out[key] = (finished or job.done(), state)
    return out


def _outcome(e: "Submitted", state: str) -> int | None:
    """None if the job measured its units; else print why (with the error's tail) and return its exit code."""
    job = e.job
    if job.paths.result_pickle.exists():
        try:
            job.result()
        except UncompletedJobError as err:
            return _report(e, _final_state(job, state), _trace_tail(str(err)))
        index = RunIndex.load(e.run_dir)
        mine = [u for u in index.units if e.units is None or u["index"] in e.units]
        if all(index.is_whole(u) for u in mine):
            print(f"twinrun: job {job.job_id} measured {_label(e)}", flush=True)
            return None
        said = f"the job returned; run.json says {index.status!r}"
        return _report(e, _final_state(job, state), [said])
    # Ended without a result: cancelled, killed at its time limit or for memory, node failure...
    log = job.stderr() or ""
    return _report(e, f"{_final_state(job, state)} without a result", _tail(log.splitlines()))


def _final_state(job, state: str) -> str:
    """The scheduler's last word, e.g. "FAILED 1:0": a job that wrote its result may still be exiting."""
    if not isinstance(job, submitit.SlurmJob):
        return state
    deadline = time.monotonic() + FINAL_STATE_WAIT_S
    queued = state
    while True:
        answer = slurm_states([job.job_id])
        queued = queued if answer is None else answer[job.job_id]
        left_queue, late = queued in SLURM_ENDED or queued == GONE, time.monotonic() > deadline
        # slurmdbd records the end after squeue shows it: ask sacct until it agrees, or accounting is off
        accounted = sacct_state(job.job_id) if left_queue or late else None
        if accounted and accounted.split()[0] in SLURM_ENDED:
            return accounted
        if (left_queue and accounted is None) or late:
            return queued
        time.sleep(0.5)


def _report(e: "Submitted", state: str, tail: list[str]) -> int:
    failure = RunIndex.load(e.run_dir).own_failure(e.units)
    said = failure.get("message") if failure and (failure.get("error") in FAILURE_EXIT_CODES
                                                  or failure.get("refused")) else None
    if said:  # twinrun refused in the job (no GPU, too little memory, determinism, a kernel path): its line
        print(f"twinrun: error: {_label(e)}: job {e.job.job_id} {state}: {said}", file=sys.stderr)
    else:
        where = f"arm {failure['arm']} failed at {failure['unit']}" if failure else "the job failed"
        print(f"twinrun: error: {_label(e)}: job {e.job.job_id} {state}: {where}; finished units are kept "
              "(submit the same run directory again to resume)", file=sys.stderr)
        for line in tail:
            print(f"  | {line}", file=sys.stderr)
    print(f"  logs: {e.job.paths.stderr}", file=sys.stderr, flush=True)
    if failure and failure.get("type"):  # the model raised (run.json records its exception): exit 4
        return EXIT_MODEL
    if failure and failure.get("refused") == "kernel_path":  # the job refused to straddle kernel paths
        return EXIT_REFUSED
    if failure and failure.get("error") in FAILURE_EXIT_CODES:  # no GPU, too little memory, determinism
        return FAILURE_EXIT_CODES[failure["error"]]
    return EXIT_GATE if failure else EXIT_USAGE


def _trace_tail(message: str) -> list[str]:
    """The end of the remote traceback inside submitit's FailedJobError message."""
    lines = message.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("-----")]
    if len(rules) >= 2:
        lines = lines[rules[0] + 1 : rules[1]]
    return _tail(lines)


def _tail(lines: list[str]) -> list[str]:
    """The last lines worth reading: no blank lines, no traceback caret underlines."""
    return [line for line in lines if line.strip(" ^~")][-TAIL_LINES:]
