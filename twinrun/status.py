"""Where a run or a sweep stands: `python -m twinrun.status RUN_DIR|SWEEP_DIR`.

Progress is read from each run directory (run.json: bins done per arm, a failure), so it shows
even on a cluster without accounting; the scheduler's state of the job named in launch.json
(written at submission) is added when the scheduler answers.
"""

import argparse
import subprocess
import sys
from pathlib import Path

from twinrun.errors import EXIT_OK, EXIT_USAGE, StoreError, fail
from twinrun.lock import holder_alive, pid_alive, read_holder
from twinrun.rundir import RUN_JSON, RunDir, RunIndex
from twinrun.store import read_json, verify_store

# SLURM job states after which the job will not run again (squeue/sacct spelling).
SLURM_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
               "DEADLINE", "SPECIAL_EXIT", "REVOKED"}
GONE = "GONE"  # the scheduler no longer knows the job (accounting off, or past MinJobAge)
SCHEDULER_TIMEOUT_S = 20


def find_runs(path: Path) -> list[Path]:
    """The run directories at `path`: itself if it holds run.json, else its sweep points."""
    path = Path(path)
    if RunDir(path).is_run():
        return [path]
    points = sorted((p for p in path.glob(f"*/{RUN_JSON}")), key=lambda p: _point_key(p.parent.name))
    if not points:
        raise StoreError(path, f"holds no {RUN_JSON} (not a run directory) and no sweep point with one")
    return [p.parent for p in points]


def _point_key(name: str):
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def progress(run_dir: Path, verify: bool = False) -> dict:
    """run.json's status, stores done per arm, the failure if any, and launch.json if written.

    verify: count a store as done only if it exists and its sha256 matches run.json (reads every
    store), list the others as damaged, tell whether the writer still lives, and add the verdict.
    """
    index = RunIndex.load(run_dir)
    rd = index.run_dir
    done, damaged = {}, []
    for arm in index.arm_names:
        ok = [b for b in index.bins if b["stores"][arm]["status"] == "done"]
        if verify:
            good = [b for b in ok if _verified(index, b, arm, damaged)]
            ok = good
        done[arm] = len(ok)
    # The twin's gate replicate has stores at gate bins only (not an arm of run.json): verify them too.
    extra = [(b, a) for b in index.bins for a in b["stores"] if a not in index.arm_names]
    if verify:
        for b, arm in extra:
            if b["stores"][arm]["status"] == "done":
                _verified(index, b, arm, damaged)
    launch = read_json(rd.launch_json) if rd.launch_json.is_file() else None
    return {
        "status": _live_status(index, launch) if verify else index.status,
        "done": done,
        "n_bins": len(index.bins),
        "failure": index.doc.get("failure"),
        "launch": launch,
        "damaged": damaged,
        "verdict": _verdict(rd) if verify else None,
    }


def _verified(index: RunIndex, b: dict, arm: str, damaged: list) -> bool:
    try:
        verify_store(index.store_path(b, arm), b["stores"][arm]["sha256"])
    except StoreError as err:
        damaged.append(str(err))
        return False
    return True


def _live_status(index: RunIndex, launch: dict | None) -> str:
    """run.json's status, corrected when it says "running" but its writer is gone."""
    if index.status != "running":
        return index.status
    alive = holder_alive(read_holder(index.run_dir.path))
    if alive is None:  # held from another host: the scheduler's state (if any) tells the rest
        return "running (on another host)"
    if alive or (launch is not None and job_state(launch) in ("RUNNING", "PENDING")):
        return "running"
    return "interrupted (its process is gone; resume with `python -m twinrun.resume RUN_DIR`)"


def _verdict(rd: RunDir) -> str | None:
    if not rd.summary_json.is_file():
        return None
    summary = read_json(rd.summary_json)
    # `passed`: every check and gate, the machinery arm's included (a run may have no gate bin).
    passed = summary.get("passed", bool(summary["gates"]) and all(g["passed"] for g in summary["gates"]))
    return "reduced: valid, gates passed" if summary["valid"] and passed else "reduced: NOT valid (checks or gates failed)"


def describe(run_dir: Path, prog: dict, state: str | None = None) -> str:
    """One line: the run, its job and state, and bins done per arm."""
    bins = ", ".join(f"{arm} {n}/{prog['n_bins']}" for arm, n in prog["done"].items())
    launch = prog["launch"]
    job = f"job {launch['job_id']}" if launch else "no job"
    line = f"{run_dir}: {prog['status']}; {job}{f' {state}' if state else ''}; bins done: {bins}"
    failure = prog["failure"]
    if failure:
        line += f"; failed: arm {failure['arm']}, bin {failure['bin_index']} (σ={failure['sigma']:g})"
    if prog.get("damaged"):
        line += f"; {len(prog['damaged'])} damaged store(s), first: {prog['damaged'][0]}"
    if prog.get("verdict"):
        line += f"; {prog['verdict']}"
    return line


# ----------------------------------------------------------------------------- scheduler


def slurm_states(job_ids: list[str]) -> dict[str, str] | None:
    """SLURM state of each job ("123" or array element "123_4") from squeue, with the reason a
    pending job waits ("PENDING (BeginTime)"); GONE if squeue no longer lists it; None if the
    scheduler does not answer. squeue needs no accounting."""
    bases = sorted({j.split("_")[0] for j in job_ids})
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-o", "%i|%T|%r", "-j", ",".join(bases)],
                             check=False, capture_output=True, text=True, timeout=SCHEDULER_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        # A single id that squeue has forgotten is an error; anything else is an unanswered query.
        return {j: GONE for j in job_ids} if "Invalid job id" in out.stderr else None
    listed = {}
    for line in out.stdout.splitlines():
        job_id, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        waiting = state == "PENDING" and reason not in ("", "None")
        listed[job_id] = f"{state} ({reason})" if waiting else state
    return {j: listed.get(j, GONE) for j in job_ids}


def sacct_state(job_id: str) -> str | None:
    """sacct's final word on a job, e.g. "FAILED 1:0" (None without accounting)."""
    try:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "State,ExitCode", "-j", job_id],
                             check=False, capture_output=True, text=True, timeout=SCHEDULER_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split("\n") if out.returncode == 0 else []
    for line in lines:
        state, _, code = line.partition("|")
        if state:
            return f"{state.split()[0]} {code}".strip()
    return None


def job_state(launch: dict | None) -> str | None:
    """The state of the job named in launch.json, as well as it can be told from here."""
    if launch is None:
        return None
    job_id, finished = launch["job_id"], Path(launch["result"]).exists()
    if launch["cluster"] == "local":  # submitit's local executor: the job id is its controller's pid
        if finished:
            return "ENDED"
        return "RUNNING" if pid_alive(int(job_id)) else "ENDED WITHOUT RESULT"
    states = slurm_states([job_id])
    state = None if states is None else states[job_id]
    if state is not None and state != GONE and state not in SLURM_ENDED:
        return state
    return sacct_state(job_id) or state or ("ENDED" if finished else "UNKNOWN")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twinrun.status",
                                     description="Show where a twinrun run (or each run of a sweep) stands.")
    parser.add_argument("path", type=Path, help="a run directory, or a sweep directory")
    args = parser.parse_args(argv)
    try:
        runs = find_runs(args.path)
        damaged = False
        for run_dir in runs:
            prog = progress(run_dir, verify=True)
            print(describe(run_dir, prog, job_state(prog["launch"])))
            damaged |= bool(prog["damaged"])
    except StoreError as err:
        fail(err)
    return EXIT_USAGE if damaged else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
