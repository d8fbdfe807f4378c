"""Submitting runs as submitit jobs: the executor's parameters, one submission (a job array if several),
and launch.json for each run."""

import datetime
from pathlib import Path

import submitit
from submitit.core.utils import UncompletedJobError

from twinrun.launchers import LAUNCHERS, check
from twinrun.launchers.jobs import PackedJob, PairJob
from twinrun.launchers.placement import Element, jobs_of, place
from twinrun.launchers.record import write_launch
from twinrun.launchers.slurm import sbatch_refused


def executor_parameters(launcher: dict, cluster: str, job_name: str) -> dict:
    """Keywords for submitit's update_parameters; a None knob is not passed (the cluster decides).
    cpus_per_task and mem_gb are per run: a pack's job asks for pack × each (its GPUs: gpus_per_node)."""
    pack = launcher.get("pack", 1) or 1
    params = {"name": job_name, "timeout_min": launcher["timeout_min"], "nodes": launcher["nodes"],
              "tasks_per_node": 1, "gpus_per_node": launcher["gpus_per_node"] or None}  # 0: ask for none
    if cluster == "local":
        params["local_setup"] = list(launcher["setup"]) or None
    else:
        params.update({
            "cpus_per_task": launcher["cpus_per_task"] * pack,
            "mem_gb": None if launcher["mem_gb"] is None else launcher["mem_gb"] * pack,
            "slurm_partition": launcher["partition"],
            "slurm_account": launcher["account"],
            "slurm_qos": launcher["qos"],
            "slurm_constraint": launcher["constraint"],
            "slurm_signal_delay_s": launcher["signal_delay_s"],
            "slurm_array_parallelism": launcher["array_parallelism"],
            "slurm_additional_parameters": dict(launcher["additional_parameters"]) or None,
            "slurm_setup": list(launcher["setup"]) or None,
        })
    return {k: v for k, v in params.items() if v is not None}


def make_executor(launcher: dict, folder_root: Path, job_name: str) -> submitit.AutoExecutor:
    cluster = LAUNCHERS[launcher["name"]].cluster
    # max_num_timeout is a constructor argument, not an update_parameters one
    executor = submitit.AutoExecutor(folder=Path(folder_root).resolve() / launcher["folder"] / "%j",
                                     cluster=cluster,
                                     **{f"{cluster}_max_num_timeout": launcher["max_num_timeout"]})
    executor.update_parameters(**executor_parameters(launcher, cluster, job_name))
    return executor


def submit(run_dirs: list[Path], launcher: dict, folder_root: Path,
           trusted=()) -> list[tuple[Element, object]]:
    """One job per planned run directory (split=pair), per pending unit (split=bins) or per pack of runs
    (pack=N), all in one submission (one SLURM job array if several). Returns [(Element, submitit job)],
    one entry per run and unit: the runs of a pack share their job.

    Writes RUN_DIR/launch.json (job ids, cluster, log paths, time) and prints each job id.
    """
    check(launcher)
    planned = place([Path(r).resolve() for r in run_dirs], launcher.get("split", "pair"),
                    launcher.get("pack", 1))
    groups = jobs_of(planned)
    folder_root = Path(folder_root)
    executor = make_executor(launcher, folder_root, f"twinrun-{folder_root.name}")
    with submitit.helpers.clean_env():  # submitting from inside an allocation must not inherit it
        try:
            with executor.batch():
                jobs = [executor.submit(_job(group, trusted, launcher["gpus_per_node"],
                                             launcher["cpus_per_task"])) for group in groups]
        except UncompletedJobError as err:  # sbatch refused the job
            raise sbatch_refused(err, launcher) from None
    submitted = [(e, job) for group, job in zip(groups, jobs) for e in group]
    cluster = LAUNCHERS[launcher["name"]].cluster
    when = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    for run_dir in dict.fromkeys(e.run_dir for e in planned):
        write_launch(run_dir, [(e, j) for e, j in submitted if e.run_dir == run_dir], cluster, launcher, when)
    kind = "SLURM" if cluster == "slurm" else "submitit local"
    if len(jobs) > 1 and cluster == "slurm":
        print(f"twinrun: submitted {kind} job array {jobs[0].job_id.split('_')[0]} ({len(jobs)} "
              f"{'runs' if len(jobs) == len(run_dirs) else 'jobs'}; logs in "
              f"{folder_root / launcher['folder']})", flush=True)
    for group, job in zip(groups, jobs):
        print(f"twinrun: submitted {kind} job {job.job_id} for {_what(group)}", flush=True)
    return submitted


def _what(group: tuple[Element, ...]) -> str:
    """What one job measures, for its submission line."""
    e = group[0]
    if e.pack:
        return f"a pack of {len(group)} runs: {' '.join(str(x.run_dir) for x in group)}"
    return f"unit {', '.join(map(str, e.units))} of {e.run_dir}" if e.units is not None else str(e.run_dir)


def _job(group: tuple[Element, ...], trusted, gpus: int, cpus: int | None = None) -> PairJob | PackedJob:
    """The callable one job runs: a pack's PackedJob, or the pair job of one run (or of its units).
    `gpus`: what the job requests (launcher.gpus_per_node), against which its device is judged; `cpus`:
    each run's CPUs (launcher.cpus_per_task), the threads a pack gives each of its processes."""
    e = group[0]
    if e.pack:
        return PackedJob([x.run_dir for x in group], trusted, cpus)
    return PairJob(e.run_dir, trusted, e.units, gpus)
