"""Submit planned runs as submitit jobs (SLURM, or submitit's local executor) and wait on them.

One run is one job whose single process measures both arms bin by bin (`PairJob`); the runs of a
sweep go out as one SLURM job array. On SLURM's preemption or time-limit signal (USR2) the job
requeues itself and the next start resumes from the finished bins. `wait` follows each job through
its run directory (progress) and the scheduler (state), never through submitit's cached state alone.
"""

import datetime
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import submitit
from submitit.core.utils import UncompletedJobError

from twinrun import status
from twinrun.errors import EXIT_GATE, EXIT_MODEL, EXIT_USAGE, ConfigError, TwinrunError
from twinrun.run import run_job
from twinrun.rundir import RunDir, RunIndex
from twinrun.store import read_json, write_json

CLUSTERS = {"submitit_local": "local", "slurm": "slurm"}  # launcher.name -> submitit's cluster
LAUNCH_FORMAT = "twinrun-launch/1"
# After USR2 the job needs this long to checkpoint, requeue itself and exit before SLURM kills it.
CHECKPOINT_MARGIN_S = 30
TAIL_LINES = 8
FINAL_STATE_WAIT_S = 15  # how long a failed job may take to leave the queue, for its final state
# A job pending for one of these reasons waits for a change of the request or the cluster, not for
# time: after this grace it is cancelled, naming the knob (`squeue` reason -> launcher knob).
UNRESOLVABLE_GRACE_S = 20
UNRESOLVABLE = {
    "PartitionConfig": "cpus_per_task, mem_gb, gpus_per_node or timeout_min",
    "PartitionTimeLimit": "timeout_min",
    "PartitionNodeLimit": "nodes",
    "ReqNodeNotAvail": "partition or constraint",
    "BadConstraints": "constraint",
    "InvalidAccount": "account",
    "InvalidQOS": "qos",
    "QOSMaxCpuPerJobLimit": "cpus_per_task",
    "QOSMaxWallDurationPerJobLimit": "timeout_min",
    "QOSMaxGRESPerJob": "gpus_per_node",
    "AssocMaxCpuPerJobLimit": "cpus_per_task",
    "AssocMaxWallDurationPerJobLimit": "timeout_min",
}
# sbatch's complaint -> the launcher knob behind it; the first match wins.
SBATCH_KNOBS = (
    ("partition", "partition"),
    ("account", "account"),
    ("qos", "qos"),
    ("feature", "constraint"),
    ("constraint", "constraint"),
    ("gres", "gpus_per_node"),
    ("gpu", "gpus_per_node"),
    ("time limit", "timeout_min"),
    ("memory", "mem_gb"),
    ("node configuration", "cpus_per_task"),
)


# ----------------------------------------------------------------------------- the job


class PairJob(submitit.helpers.Checkpointable):
    """The job: measure every pending (arm, bin) of one planned run directory.

    Its only state is the run directory. On USR2 submitit calls `checkpoint`, which requeues this
    same object; the next start runs `run_job` again, which skips every bin whose arms' stores all
    exist and verify (a half-measured bin is measured again, whole), so no finished bin is recomputed.
    """

    def __init__(self, run_dir: str | Path, trusted=()):
        self.run_dir = str(Path(run_dir).resolve())
        self.trusted = list(trusted)  # builders the submitting user composed or named (see run.load_arms)

    def __call__(self) -> str:
        run_dir = Path(self.run_dir)
        print(f"twinrun: {_where()}: {run_dir}; {_stores_done(run_dir)}", flush=True)
        try:
            return run_job(run_dir, getattr(self, "trusted", ()))["status"]
        except TwinrunError as err:
            # One readable line before submitit's traceback; re-raised, so the job ends FAILED.
            print(f"twinrun: error: {err}", file=sys.stderr, flush=True)
            raise

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        print(f"twinrun: signalled ({_where()}): {_stores_done(Path(self.run_dir))}; requeueing, "
              "the next start resumes from them", flush=True)
        return super().checkpoint(*args, **kwargs)


def _where() -> str:
    """This process's allocation, for the job's log."""
    env = os.environ
    job = env.get("SLURM_JOB_ID") or env.get("SUBMITIT_LOCAL_JOB_ID") or "-"
    task = env.get("SLURM_ARRAY_TASK_ID")
    restart = env.get("SLURM_RESTART_COUNT", "0")
    return (f"job {job}{f' array task {task}' if task else ''} start {int(restart) + 1} "
            f"on {socket.gethostname()} pid {os.getpid()}")


def _stores_done(run_dir: Path) -> str:
    """Which bins are already whole (every arm's store done), as run.json says."""
    index = RunIndex.load(run_dir)
    whole = [b["index"] for b in index.whole_bins(verify=False)]
    if not whole:
        return f"0/{len(index.bins)} bins done"
    return f"{len(whole)}/{len(index.bins)} bins done (skipped on resume: {', '.join(map(str, whole))})"


# ----------------------------------------------------------------------------- bad input


def check(launcher: dict) -> None:
    """Refuse launcher settings that cannot work, naming the knob (ConfigError: exit 2).

    Asks SLURM (sinfo) about the partition and its GPUs; call it before planning to fail early.
    """
    name = launcher["name"]
    if name == "local":
        return
    if name not in CLUSTERS:
        raise ConfigError("launcher.name", name, "choose local, submitit_local or slurm")
    if launcher["nodes"] != 1:
        raise ConfigError("launcher.nodes", launcher["nodes"], "must be 1: both arms of a pair run in one "
                          "process, so more nodes would idle (a sweep runs its points as a job array)")
    for key, low in (("timeout_min", 1), ("cpus_per_task", 1), ("gpus_per_node", 0), ("signal_delay_s", 0),
                     ("max_num_timeout", 0), ("array_parallelism", 1)):
        if launcher[key] < low:
            raise ConfigError(f"launcher.{key}", launcher[key], f"must be ≥ {low}")
    if launcher["mem_gb"] is not None and launcher["mem_gb"] <= 0:
        raise ConfigError("launcher.mem_gb", launcher["mem_gb"],
                          "must be > 0, or null for the cluster's default")
    if not launcher["poll_s"] > 0:
        raise ConfigError("launcher.poll_s", launcher["poll_s"], "must be > 0 seconds")
    if name == "slurm":
        _check_slurm(launcher)


def _check_slurm(launcher: dict) -> None:
    if shutil.which("sbatch") is None:
        raise ConfigError("launcher", "slurm", "sbatch is not on PATH: run where SLURM is installed (a local "
                          "test cluster: `bash launch/slurm-up.sh`), or use launcher=local or submitit_local")
    timeout_min, delay_s = launcher["timeout_min"], launcher["signal_delay_s"]
    if timeout_min * 60 <= delay_s + CHECKPOINT_MARGIN_S:
        least = (delay_s + CHECKPOINT_MARGIN_S) // 60 + 1
        raise ConfigError("launcher.timeout_min", timeout_min,
                          f"leaves no time to run: the job is signalled launcher.signal_delay_s={delay_s} s "
                          f"before the limit and needs {CHECKPOINT_MARGIN_S} s more to requeue; use "
                          f"timeout_min ≥ {least} or a smaller signal_delay_s")
    partitions = _sinfo()
    names = [p.rstrip("*") for p in partitions]
    partition = launcher["partition"]
    if partition is None:
        default = [p.rstrip("*") for p in partitions if p.endswith("*")]
        if not default:
            raise ConfigError("launcher.partition", None,
                              f"this cluster has no default partition; choose one of {', '.join(names)}")
        partition = default[0]
    elif partition not in names:
        raise ConfigError("launcher.partition", partition,
                          f"no such partition on this cluster; choose one of {', '.join(names)}")
    nodes = [n for p, ns in partitions.items() if p.rstrip("*") == partition for n in ns]
    gres = {n["gres"] for n in nodes}
    if launcher["gpus_per_node"] > 0 and not any("gpu" in g for g in gres):
        raise ConfigError("launcher.gpus_per_node", launcher["gpus_per_node"],
                          f"partition {partition} has no GPUs (sinfo gres: {', '.join(sorted(gres))}); "
                          "use launcher.gpus_per_node=0 to run on CPUs, or a GPU partition")
    _check_fits(launcher, partition, nodes)


def _check_fits(launcher: dict, partition: str, nodes: list[dict]) -> None:
    """CPUs, memory and time asked for must fit some node of the partition, else the job would pend
    forever (PartitionConfig); checked before submission, naming the knob."""
    most_cpus = max((n["cpus"] for n in nodes if n["cpus"] is not None), default=None)
    if most_cpus is not None and launcher["cpus_per_task"] > most_cpus:
        raise ConfigError("launcher.cpus_per_task", launcher["cpus_per_task"],
                          f"partition {partition}'s largest node has {most_cpus} CPUs; ask for at most that")
    most_mb = max((n["mem_mb"] for n in nodes if n["mem_mb"] is not None), default=None)
    if most_mb is not None and launcher["mem_gb"] is not None and launcher["mem_gb"] * 1024 > most_mb:
        raise ConfigError("launcher.mem_gb", launcher["mem_gb"],
                          f"partition {partition}'s largest node has {most_mb / 1024:.1f} GB; ask for at most that "
                          "(or null for the cluster's default)")
    limits = [n["limit_min"] for n in nodes]
    if limits and None not in limits and launcher["timeout_min"] > max(limits):
        raise ConfigError("launcher.timeout_min", launcher["timeout_min"],
                          f"partition {partition}'s time limit is {max(limits)} min; ask for at most that "
                          "(the job checkpoints and requeues itself at the limit)")


def _minutes(limit: str) -> int | None:
    """sinfo's time limit ("infinite", "MM", "HH:MM:SS", "D-HH:MM:SS") in minutes; None = no limit."""
    if limit in ("infinite", "UNLIMITED", "n/a", ""):
        return None
    days, _, clock = limit.rpartition("-")
    parts = [int(x) for x in clock.split(":")] if all(x.isdigit() for x in clock.split(":")) else []
    if not parts or (days and not days.isdigit()):
        return None
    h, m, sec = ([0] * (3 - len(parts)) + parts) if len(parts) > 1 else (0, parts[0], 0)
    return int(days or 0) * 1440 + h * 60 + m + (1 if sec else 0)


def _number(text: str) -> int | None:
    text = text.strip().rstrip("+")
    return int(text) if text.isdigit() else None


def _sinfo() -> dict[str, list[dict]]:
    """{partition (the default marked '*'): its node kinds (gres, cpus, mem_mb, limit_min)} from sinfo."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P|%G|%c|%m|%l"], check=False, capture_output=True, text=True,
                             timeout=status.SCHEDULER_TIMEOUT_S)
        reason = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
    except (OSError, subprocess.TimeoutExpired) as err:
        out, reason = None, str(err)
    if out is None or out.returncode != 0:
        raise ConfigError("launcher", "slurm", f"SLURM does not answer (sinfo: {reason}); check the cluster "
                          "with `sinfo` (a local test cluster: `bash launch/slurm-up.sh`)")
    partitions: dict[str, list[dict]] = {}
    for line in out.stdout.splitlines():
        partition, gres, cpus, mem, limit = ([*line.split("|"), "", "", "", ""])[:5]
        partitions.setdefault(partition.strip(), []).append(
            {"gres": gres.strip(), "cpus": _number(cpus), "mem_mb": _number(mem), "limit_min": _minutes(limit.strip())})
    return partitions


def _sbatch_refused(err: Exception, launcher: dict) -> ConfigError:
    """sbatch's refusal as a one-line error naming the knob it most likely concerns."""
    lines = [line.removeprefix("sbatch: error: ") for line in str(err).strip().splitlines()] or [str(err)]
    said = "; ".join(lines)
    for word, knob in SBATCH_KNOBS:
        if word in said.lower():
            return ConfigError(f"launcher.{knob}", launcher[knob], f"sbatch refused the job: {said}")
    return ConfigError("launcher.additional_parameters", launcher["additional_parameters"],
                       f"sbatch refused the job: {said}")


# ----------------------------------------------------------------------------- submit


def executor_parameters(launcher: dict, cluster: str, job_name: str) -> dict:
    """Keywords for submitit's update_parameters; a None knob is not passed (the cluster decides)."""
    params = {"name": job_name, "timeout_min": launcher["timeout_min"], "nodes": launcher["nodes"],
              "tasks_per_node": 1, "gpus_per_node": launcher["gpus_per_node"] or None}  # 0: ask for none
    if cluster == "local":
        params["local_setup"] = list(launcher["setup"]) or None
    else:
        params.update({
            "cpus_per_task": launcher["cpus_per_task"],
            "mem_gb": launcher["mem_gb"],
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
    cluster = CLUSTERS[launcher["name"]]
    # max_num_timeout is a constructor argument, not an update_parameters one
    executor = submitit.AutoExecutor(folder=Path(folder_root).resolve() / launcher["folder"] / "%j",
                                     cluster=cluster,
                                     **{f"{cluster}_max_num_timeout": launcher["max_num_timeout"]})
    executor.update_parameters(**executor_parameters(launcher, cluster, job_name))
    return executor


def submit(run_dirs: list[Path], launcher: dict, folder_root: Path, trusted=()) -> list:
    """One job per planned run directory, all in one submission (one SLURM job array if several).

    Writes RUN_DIR/launch.json (job id, cluster, log paths, time) and prints each job id.
    """
    check(launcher)
    run_dirs = [Path(r).resolve() for r in run_dirs]
    folder_root = Path(folder_root)
    executor = make_executor(launcher, folder_root, f"twinrun-{folder_root.name}")
    with submitit.helpers.clean_env():  # submitting from inside an allocation must not inherit it
        try:
            with executor.batch():
                jobs = [executor.submit(PairJob(run_dir, trusted)) for run_dir in run_dirs]
        except UncompletedJobError as err:  # sbatch refused the job
            raise _sbatch_refused(err, launcher) from None
    cluster = CLUSTERS[launcher["name"]]
    submitted = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    for run_dir, job in zip(run_dirs, jobs):
        _write_launch(run_dir, job, cluster, launcher, submitted)
    kind = "SLURM" if cluster == "slurm" else "submitit local"
    if len(jobs) > 1 and cluster == "slurm":
        print(f"twinrun: submitted {kind} job array {jobs[0].job_id.split('_')[0]} ({len(jobs)} runs; "
              f"logs in {folder_root / launcher['folder']})", flush=True)
    for run_dir, job in zip(run_dirs, jobs):
        print(f"twinrun: submitted {kind} job {job.job_id} for {run_dir}", flush=True)
    return jobs


def _write_launch(run_dir: Path, job, cluster: str, launcher: dict, submitted: str) -> None:
    path = RunDir(run_dir).launch_json
    earlier = []
    if path.is_file():  # a resubmission into the same run directory: keep the history
        old = read_json(path)
        earlier = old.pop("earlier", []) + [old]
    array_id, _, task = job.job_id.partition("_")
    write_json(path, {
        "format": LAUNCH_FORMAT,
        "cluster": cluster,
        "job_id": job.job_id,
        "array_job_id": array_id if task else None,
        "array_task_id": int(task) if task else None,
        "submitted": submitted,
        "folder": str(job.paths.folder),
        "stdout": str(job.paths.stdout),
        "stderr": str(job.paths.stderr),
        "result": str(job.paths.result_pickle),
        "launcher": launcher,
        "earlier": earlier,
    })


# ----------------------------------------------------------------------------- wait


def wait(run_dirs: list[Path], jobs: list, launcher: dict) -> dict[Path, int]:
    """Block until every job has ended, printing state and bins done as they change.

    Returns {run_dir: exit code} for the runs that failed (1: an arm raised, run.json names it;
    2: the job died or failed otherwise), after printing the error's tail; the rest measured.
    """
    pending = {Path(r): job for r, job in zip(run_dirs, jobs)}
    keys = dict(zip(pending, run_dirs))  # report under the caller's own Path objects
    shown: dict[Path, str] = {}
    failed: dict[Path, int] = {}
    stuck_since: dict[Path, float] = {}
    try:
        while pending:
            for run_dir, (ended, state) in _poll(pending).items():
                if _stuck(run_dir, state, stuck_since):
                    failed[keys[run_dir]] = _cancel_stuck(run_dir, pending.pop(run_dir), state)
                    continue
                line = status.describe(run_dir, status.progress(run_dir), state)
                if shown.get(run_dir) != line:
                    print(f"twinrun: {line}", flush=True)
                    shown[run_dir] = line
                if ended:
                    code = _outcome(run_dir, pending.pop(run_dir), state)
                    if code is not None:
                        failed[keys[run_dir]] = code
            if pending:
                time.sleep(launcher["poll_s"])
    except KeyboardInterrupt:
        where = " ".join(str(r) for r in pending)
        print(f"\ntwinrun: stopped waiting; the jobs keep running. Follow them with "
              f"`python -m twinrun.status {where}`, then reduce with `python -m twinrun.reduce RUN_DIR`",
              file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    return failed


def _stuck(run_dir: Path, state: str, since: dict) -> bool:
    """Pending, for longer than the grace, for a reason no amount of waiting resolves."""
    reason = state.partition("(")[2].rstrip(")").split(",")[0].strip() if state.startswith("PENDING") else ""
    if reason not in UNRESOLVABLE:
        since.pop(run_dir, None)
        return False
    return time.monotonic() - since.setdefault(run_dir, time.monotonic()) > UNRESOLVABLE_GRACE_S


def _cancel_stuck(run_dir: Path, job, state: str) -> int:
    reason = state.partition("(")[2].rstrip(")").split(",")[0].strip()
    job.cancel(check=False)
    print(f"twinrun: error: {run_dir}: job {job.job_id} cancelled: it was {state}, which waiting cannot "
          f"resolve; change launcher.{UNRESOLVABLE[reason].replace(', ', ', launcher.').replace(' or ', ' or launcher.')} "
          "to fit the partition and resume", file=sys.stderr, flush=True)
    return EXIT_USAGE


def _poll(pending: dict) -> dict[Path, tuple[bool, str]]:
    """{run_dir: (ended, state)}: squeue first (one call, needs no accounting), sacct if it is mute."""
    jobs = list(pending.values())
    slurm = [j for j in jobs if isinstance(j, submitit.SlurmJob)]
    queue = status.slurm_states([j.job_id for j in slurm]) if slurm else None
    if slurm and queue is None:
        slurm[0].get_info(mode="force")  # one forced sacct updates submitit's shared watcher for all
    out = {}
    for run_dir, job in pending.items():
        finished = job.paths.result_pickle.exists()
        if not isinstance(job, submitit.SlurmJob):
            out[run_dir] = (finished or job.done(), job.state)
        elif queue is not None:
            state = queue[job.job_id]
            out[run_dir] = (finished or state in status.SLURM_ENDED or state == status.GONE, state)
        else:
            state = (job.get_info(mode="cache").get("State") or "UNKNOWN").split()[0]
            out[run_dir] = (finished or job.done(), state)
    return out


def _outcome(run_dir: Path, job, state: str) -> int | None:
    """None if the run measured; else print why (with the error's tail) and return its exit code."""
    if job.paths.result_pickle.exists():
        try:
            job.result()
        except UncompletedJobError as err:
            return _report(run_dir, job, _final_state(job, state), _trace_tail(str(err)))
        prog = status.progress(run_dir)
        if prog["status"] == "measured":
            print(f"twinrun: job {job.job_id} measured {run_dir}", flush=True)
            return None
        said = f"the job returned; run.json says {prog['status']!r}"
        return _report(run_dir, job, _final_state(job, state), [said])
    # Ended without a result: cancelled, killed at its time limit or for memory, node failure...
    log = job.stderr() or ""
    return _report(run_dir, job, f"{_final_state(job, state)} without a result", _tail(log.splitlines()))


def _final_state(job, state: str) -> str:
    """The scheduler's last word, e.g. "FAILED 1:0": a job that wrote its result may still be exiting."""
    if not isinstance(job, submitit.SlurmJob):
        return state
    deadline = time.monotonic() + FINAL_STATE_WAIT_S
    queued = state
    while True:
        answer = status.slurm_states([job.job_id])
        queued = queued if answer is None else answer[job.job_id]
        if queued in status.SLURM_ENDED or queued == status.GONE or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    accounted = status.sacct_state(job.job_id)
    if accounted and accounted.split()[0] in status.SLURM_ENDED:
        return accounted
    return queued


def _report(run_dir: Path, job, state: str, tail: list[str]) -> int:
    failure = status.progress(run_dir)["failure"]
    where = (f"arm {failure['arm']} failed at bin {failure['bin_index']} (σ={failure['sigma']:g})"
             if failure else "the job failed")
    print(f"twinrun: error: {run_dir}: job {job.job_id} {state}: {where}; finished bins are kept "
          "(submit the same run directory again to resume)", file=sys.stderr)
    for line in tail:
        print(f"  | {line}", file=sys.stderr)
    print(f"  logs: {job.paths.stderr}", file=sys.stderr, flush=True)
    if failure and failure.get("type"):  # the model raised (run.json records its exception): exit 4
        return EXIT_MODEL
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
