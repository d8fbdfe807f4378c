"""Where a run or a sweep stands: `python -m twinrun.status RUN_DIR|SWEEP_DIR`.

Progress is read from each run directory (run.json: units done per arm, a failure), so it shows
even on a cluster without accounting; the scheduler's state of the job named in launch.json
(written at submission) is added when the launcher's scheduler answers (twinrun.launchers.record).
"""

from twinrun.errors import exit_as_command, exit_on_signals

if __name__ == "__main__":  # as a command: a signal while the imports below load is one line too
    exit_on_signals()

import argparse
from pathlib import Path

from twinrun.errors import EXIT_OK, EXIT_USAGE, Interrupted, StoreError, TwinrunError, fail, raise_on_signals
from twinrun.launchers.record import describe, element_states, job_state, progress
from twinrun.launchers.slurm import ACTIVE
from twinrun.measures.registry import load_index
from twinrun.storage.lock import holder_alive, read_holder
from twinrun.storage.rundir import RunDir, RunIndex
from twinrun.storage.store import verify_store
from twinrun.storage.sweepdir import SweepDir


def find_runs(path: Path) -> list[Path]:
    """The run directories at `path`: itself if it holds run.json, else its sweep points."""
    path = Path(path)
    if RunDir(path).is_run():
        return [path]
    points = SweepDir(path).point_dirs() if path.is_dir() else []
    if not points:
        raise StoreError(path, "holds no run.json (not a run directory) and no sweep point with one")
    return points


def verified_progress(run_dir: Path) -> dict:
    """progress(), with every store done counted only if it exists and its sha256 matches run.json
    (reads every store), the others listed as damaged, whether the writer still lives, and the verdict."""
    index, kind = load_index(run_dir)
    reader = kind.verify_store or verify_store
    prog, damaged = progress(index), []
    for arm in index.arm_names:
        prog["done"][arm] = sum(_verified(index, u, arm, damaged, reader) for u in index.units)
    for u in index.units:  # the twin's gate replicate (not an arm of run.json): verified too
        for arm in set(u["stores"]) - set(index.arm_names):
            _verified(index, u, arm, damaged, reader)
    prog.update(status=_live_status(index, prog["launch"]), damaged=damaged,
                verdict=_verdict(index.run_dir, index.status, kind.summary_type))
    return prog


def _verified(index: RunIndex, u: dict, arm: str, damaged: list, reader) -> bool:
    if index.store_entry(u, arm)["status"] != "done":
        return False
    entry = index.store_entry(u, arm)
    try:
        reader(index.store_path(u, arm), entry["sha256"], payload_bytes=entry.get("payload_bytes"))
    except StoreError as err:
        damaged.append(str(err))
        return False
    return True


def _live_status(index: RunIndex, launch: dict | None) -> str:
    """run.json's status, corrected when it says "running" but its writer is gone."""
    if index.status != "running":
        return index.status
    # The run's writer, or (split by units) the writer of any unit.
    rd = index.run_dir
    holders = [read_holder(rd.lock), *(read_holder(rd.unit_lock(u["index"])) for u in index.units)]
    alive = [holder_alive(h) for h in holders if h]
    if alive and all(a is None for a in alive):  # held from another host: the scheduler tells the rest
        return "running (on another host)"
    state = job_state(launch) if launch is not None else None
    gone = _stopped_elements(index, launch)
    if any(alive) or (state is not None and state.split()[0] in ("RUNNING", "PENDING")):
        if gone:  # an element interrupted beside others that still measure: its units wait for a resume
            return (f"running; unit {', '.join(map(str, gone))} interrupted (its job is gone: resume the run "
                    "once the others end)")
        return "running"
    return "interrupted (its process is gone; resume with `python -m twinrun.resume RUN_DIR`)"


def _stopped_elements(index: RunIndex, launch: dict | None) -> list[int]:
    """The units of array elements that ended (not active in the scheduler) with their units not whole."""
    each = element_states(launch) if launch is not None else None
    whole = {u["index"] for u in index.whole_units()}
    return sorted({i for units, state in each or [] if state.split()[0] not in ACTIVE
                   for i in (units if isinstance(units, list) else []) if i not in whole})


def _verdict(rd: RunDir, status: str, summary_type: type) -> str | None:
    if not rd.has_summary():
        # measured and never reduced (a launcher.wait=false submission, a Ctrl-C'd wait): say how
        return f"not reduced yet: `python -m twinrun.reduce {rd.path}`" if status == "measured" else None
    summary = rd.read_summary(summary_type)
    # `passed`: every check and gate, the machinery arm's included (a run may have no gate bin).
    return ("reduced: valid, gates passed" if summary["passed"]
            else "reduced: NOT valid (checks or gates failed)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twinrun.status",
                                     description="Show where a twinrun run (or each run of a sweep) stands.")
    parser.add_argument("path", type=Path, help="a run directory, or a sweep directory")
    args = parser.parse_args(argv)
    raise_on_signals()
    try:
        runs = find_runs(args.path)
        damaged, unreduced = False, False
        for run_dir in runs:
            prog = verified_progress(run_dir)
            print(describe(run_dir, prog, job_state(prog["launch"])))
            damaged |= bool(prog["damaged"])
            unreduced |= prog["status"] == "measured" and not RunDir(run_dir).has_summary()
        if unreduced and runs != [args.path]:  # a sweep: one command reduces every point and the sweep
            print("reduce every measured point and write the sweep summary: "
                  f"`python -m twinrun.sweep {args.path}`")
    except (TwinrunError, Interrupted) as err:
        fail(err)
    return EXIT_USAGE if damaged else EXIT_OK


if __name__ == "__main__":
    exit_as_command(main)
