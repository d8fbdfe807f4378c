"""launch.json: the job a run was submitted as (ids, cluster, logs, launcher settings), its schema, the
scheduler's state of it, and the line `status` and waiting print for a run.

A run directory is data: launch.json is validated field by field (a job id reaches squeue as an
argument), and resubmitting from it takes only settings that cannot carry code (no setup lines, no
extra sbatch options, every knob held to the sbatch word pattern).
"""

import re
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from twinrun.config import LauncherConfig
from twinrun.errors import StoreError
from twinrun.files import read_json, safe_name, write_json
from twinrun.launchers import LAUNCHERS
from twinrun.launchers.slurm import ACTIVE, unsafe_sbatch_knob
from twinrun.storage.rundir import RunDir, RunIndex
from twinrun.storage.typed import Checker, show

LAUNCH_FORMAT = "twinrun-launch/1"


def validate_launch(path: Path, launch: dict) -> dict:
    """launch.json: the job a run was submitted as (its id reaches squeue/sacct as an argument)."""
    c = Checker(path)
    cluster = c.one_of(launch, "cluster", "cluster", ("local", "slurm"))
    _validate_job_record(c, launch, "", cluster)
    c.get(launch, "folder", "folder", str)
    c.get(launch, "launcher", "launcher", dict)
    pack = c.get(launch, "pack", "pack", list, optional=True) or []
    if not all(isinstance(r, str) for r in pack):
        c.fail("pack", f"{show(pack)} is not a list of run directories")
    # launcher.split=bins: every element's job (its units, id and logs)
    for i, element in enumerate(c.get(launch, "elements", "elements", list, optional=True) or []):
        if not isinstance(element, dict):
            c.fail(f"elements[{i}]", f"{show(element)} is not an object")
        units = c.get(element, "units", f"elements[{i}].units", list)
        if not all(type(k) is int and k >= 0 for k in units):
            c.fail(f"elements[{i}].units", f"{show(units)} is not a list of unit indices")
        _validate_job_record(c, element, f"elements[{i}].", cluster)
    return launch


# A local job's id is its controller's pid, which status signals (kill(pid, 0)): Linux's pids lie in
# [1, 2**22) (pid_max's ceiling); 0 would signal status's own process group.
LOCAL_JOB_ID_END = 2**22


def _validate_job_record(c: Checker, record: dict, where: str, cluster: str) -> None:
    job_id = c.get(record, "job_id", f"{where}job_id", str)
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job_id):
        c.fail(f"{where}job_id", f"{show(job_id)} is not a job id")
    if cluster == "local" and not (job_id.isdigit() and 1 <= int(job_id) < LOCAL_JOB_ID_END):
        c.fail(f"{where}job_id", f"{show(job_id)} is not a local job's process id "
               f"(1 to {LOCAL_JOB_ID_END - 1})")
    for key in ("result", "stdout", "stderr"):
        c.get(record, key, f"{where}{key}", str)


def read_launch(rd: RunDir) -> dict | None:
    """launch.json, validated; None when the run was never submitted."""
    return validate_launch(rd.launch_json, read_json(rd.launch_json)) if rd.launch_json.is_file() else None


def write_launch(run_dir: Path, submitted: list, cluster: str, launcher: dict, when: str) -> None:
    """launch.json: the run's job (split=pair), or its first with every element listed (split=bins).
    `submitted`: [(Element, submitit job)] of this run, in submission order."""
    path = RunDir(run_dir).launch_json
    earlier = []
    if path.is_file():  # a resubmission into the same run directory: keep the history
        old = read_json(path)
        earlier = old.pop("earlier", []) + [old]
    job = submitted[0][1]
    array_id, _, task = job.job_id.partition("_")
    record = {
        "format": LAUNCH_FORMAT,
        "cluster": cluster,
        **_job_record(job),
        "array_job_id": array_id if task else None,
        "array_task_id": int(task) if task else None,
        "submitted": when,
        "folder": str(job.paths.folder),
        "launcher": launcher,
        "earlier": earlier,
    }
    if submitted[0][0].units is not None:
        record["elements"] = [{"units": e.units, **_job_record(j)} for e, j in submitted]
    if submitted[0][0].pack:  # launcher.pack: the runs measured beside this one, by the same job
        record["pack"] = [str(r) for r in submitted[0][0].pack]
    write_json(path, record)


def _job_record(job) -> dict:
    return {"job_id": job.job_id, "stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr),
            "result": str(job.paths.result_pickle)}


def job_state(launch: dict | None) -> str | None:
    """The state of the job(s) launch.json names: the job's, or for a run split by units the most
    active element's, followed by every element's ("RUNNING (unit 0 COMPLETED 0:0, unit 1 RUNNING)")."""
    if launch is None:
        return None
    each = element_states(launch)
    if each is None:
        return next(l for l in LAUNCHERS.values() if l.cluster == launch["cluster"]).state(launch)
    active = [s for _, s in each if s.split()[0] in ACTIVE]
    head = (active or [each[0][1]])[0].split()[0]
    return f"{head} ({', '.join(f'unit {_units_text(b)} {s}' for b, s in each)})"


def element_states(launch: dict) -> list[tuple[list | None, str]] | None:
    """[(units, state)] of each array element of a run split by units; None for a run of one job."""
    elements = launch.get("elements")
    if not isinstance(elements, list) or not elements:
        return None
    state = next(l for l in LAUNCHERS.values() if l.cluster == launch["cluster"]).state
    return [(e.get("units"), state(e)) for e in elements]


def _units_text(units) -> str:
    return ", ".join(map(str, units)) if isinstance(units, list) else "?"


def progress(index: RunIndex) -> dict:
    """run.json's status, stores done per arm, the failure if any, and launch.json if written."""
    done = {arm: sum(u["stores"][arm]["status"] == "done" for u in index.units) for arm in index.arm_names}
    return {"status": index.status, "done": done, "n_units": len(index.units), "failure": index.failure,
            "launch": read_launch(index.run_dir), "damaged": [], "verdict": None}


def describe(run_dir: Path, prog: dict, state: str | None = None) -> str:
    """One line: the run, its job and state, and units done per arm."""
    units = ", ".join(f"{arm} {n}/{prog['n_units']}" for arm, n in prog["done"].items())
    launch = prog["launch"]
    elements = (launch or {}).get("elements") or []
    job = _jobs_text(elements) if elements else f"job {launch['job_id']}" if launch else "no job"
    if launch and launch.get("pack"):
        job += f" (a pack of {len(launch['pack'])} runs)"
    line = f"{run_dir}: {prog['status']}; {job}{f' {state}' if state else ''}; units done: {units}"
    failure = prog["failure"]
    if failure:
        line += f"; failed: arm {failure['arm']}, {failure['unit']}"
    if prog.get("damaged"):
        line += f"; {len(prog['damaged'])} damaged store(s), first: {prog['damaged'][0]}"
    if prog.get("verdict"):
        line += f"; {prog['verdict']}"
    return line


def _jobs_text(elements: list[dict]) -> str:
    """A run's element jobs: "job array 123 (6 elements)" when they are one array, else their ids."""
    ids = [str(e.get("job_id")) for e in elements]
    arrays = {i.partition("_")[0] for i in ids}
    if len(arrays) == 1 and all("_" in i for i in ids):
        return f"job array {arrays.pop()} ({len(ids)} elements)"
    return f"jobs {', '.join(ids)}"


def submitted_launcher(rd: RunDir) -> dict | None:
    """The SLURM launcher settings launch.json recorded, checked like a config; None if not a SLURM run."""
    launch = read_launch(rd)
    if launch is None or launch["cluster"] != "slurm":
        return None
    state = job_state(launch)
    if state is not None and state.split()[0] in ACTIVE:
        raise StoreError(rd.path, f"its job {launch['job_id']} is still {state}: wait for it, or scancel it "
                         "and resume again")
    try:
        launcher = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(LauncherConfig),
                                                          launch["launcher"]))
    except OmegaConfBaseException as err:
        raise StoreError(rd.launch_json, f"field launcher: {str(err).splitlines()[0]}") from None
    safe_name(launcher["folder"], "launcher.folder", rd.launch_json)
    if launcher["setup"]:
        # Shell lines from a file anyone could have edited: run them only from the user's own command.
        raise StoreError(rd.launch_json, f"field launcher.setup holds shell lines {launcher['setup']}; a run "
                         "directory never runs code: rerun your original command with hydra.run.dir=RUN_DIR, "
                         "or resume with --local")
    if launcher["additional_parameters"]:
        # sbatch options from a file anyone could have edited (`export: LD_PRELOAD=…`): the user's own only.
        raise StoreError(rd.launch_json, f"field launcher.additional_parameters holds sbatch options "
                         f"{launcher['additional_parameters']}; a run directory chooses no job options: "
                         "rerun your original command with hydra.run.dir=RUN_DIR, or resume with --local")
    bad = unsafe_sbatch_knob(launcher, trusted=False)
    if bad is not None:
        raise StoreError(rd.launch_json, f"field launcher.{bad[0]}: {bad[1]!r} may hold only letters, digits "
                         "and _.,:@%+=|&()[]*- (it becomes a line of the sbatch script); fix or remove it, "
                         "or resume with --local")
    print(f"twinrun: {rd.path} was a SLURM run: submitting it again (--local to measure here)", flush=True)
    return launcher
