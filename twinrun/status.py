"""Where a run or a sweep stands: `python -m twinrun.status RUN_DIR|SWEEP_DIR`.

Progress is read from each run directory (run.json: bins done per arm, a failure), so it shows
even on a cluster without accounting; the scheduler's state of the job named in launch.json
(written at submission) is added when the launcher's scheduler answers (twinrun.launch.job_state).
"""

import argparse
import sys
from pathlib import Path

from twinrun.errors import EXIT_OK, EXIT_USAGE, StoreError, fail
from twinrun.lock import holder_alive, read_holder
from twinrun.rundir import RUN_JSON, RunDir, RunIndex
from twinrun.store import read_json, verify_store


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
    from twinrun.launch import job_state

    # The run's writer, or (split by bins) the writer of any bin.
    rd = index.run_dir
    holders = [read_holder(rd.path), *(_bin_holder(rd, b["index"]) for b in index.bins)]
    alive = [holder_alive(h) for h in holders if h]
    if alive and all(a is None for a in alive):  # held from another host: the scheduler tells the rest
        return "running (on another host)"
    state = job_state(launch) if launch is not None else None
    if any(alive) or (state is not None and state.split()[0] in ("RUNNING", "PENDING")):
        return "running"
    return "interrupted (its process is gone; resume with `python -m twinrun.resume RUN_DIR`)"


def _bin_holder(rd: RunDir, index: int) -> dict | None:
    return read_holder(rd.path, rd.bin_lock(index))


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
    elements = (launch or {}).get("elements") or []
    job = (f"jobs {', '.join(str(e.get('job_id')) for e in elements)}" if elements
           else f"job {launch['job_id']}" if launch else "no job")
    line = f"{run_dir}: {prog['status']}; {job}{f' {state}' if state else ''}; bins done: {bins}"
    failure = prog["failure"]
    if failure:
        line += f"; failed: arm {failure['arm']}, bin {failure['bin_index']} (σ={failure['sigma']:g})"
    if prog.get("damaged"):
        line += f"; {len(prog['damaged'])} damaged store(s), first: {prog['damaged'][0]}"
    if prog.get("verdict"):
        line += f"; {prog['verdict']}"
    return line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twinrun.status",
                                     description="Show where a twinrun run (or each run of a sweep) stands.")
    parser.add_argument("path", type=Path, help="a run directory, or a sweep directory")
    args = parser.parse_args(argv)
    from twinrun.launch import job_state

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
