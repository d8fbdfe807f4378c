"""The launchers (LAUNCHERS: local, submitit_local, slurm): check settings, submit runs as submitit jobs,
ask the scheduler how they stand, and wait on them.

launcher.split=pair: one run is one job whose single process measures every arm bin by bin.
launcher.split=bins: each pending bin of a run is its own job (both arms and the gate replicate
inside: the bin is the unit of twin validity). Everything submitted at once (a sweep's points, or
points × bins) goes out as one SLURM job array. On SLURM's preemption or time-limit signal (USR2) a
job requeues itself and the next start resumes from its finished bins. `wait` follows each job
through its run directory (progress) and the scheduler (state), never submitit's cached state alone.
Adding a launcher is one entry in LAUNCHERS.
"""

import datetime
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import submitit
from submitit.core.utils import UncompletedJobError

from twinrun import status
from twinrun.errors import EXIT_GATE, EXIT_MODEL, EXIT_REFUSED, EXIT_USAGE, ConfigError, TwinrunError
from twinrun.run import run_job
from twinrun.rundir import RunDir, RunIndex
from twinrun.store import read_json, write_json

LAUNCH_FORMAT = "twinrun-launch/1"
SPLITS = ("pair", "bins")  # launcher.split: one job per run, or one job per bin
# SLURM job states after which the job will not run again (squeue/sacct spelling).
SLURM_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
               "DEADLINE", "SPECIAL_EXIT", "REVOKED"}
GONE = "GONE"  # the scheduler no longer knows the job (accounting off, or past MinJobAge)
ACTIVE = ("RUNNING", "PENDING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED")
# submitit writes each SLURM knob into the sbatch script as `#SBATCH --key=value`: a newline in one
# would become a shell line of the script. What a partition, account, qos, constraint (or an
# additional_parameters key) may hold: SLURM's names and constraint expressions, nothing a shell reads.
SBATCH_WORD = re.compile(r"[A-Za-z0-9_.,:@%+=|&()\[\]*-]+")
SBATCH_WORD_KNOBS = ("partition", "account", "qos", "constraint")
SCHEDULER_TIMEOUT_S = 20
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
    """The job: measure every pending (arm, bin) of one planned run directory, or of its `bins` only
    (one array element of launcher.split=bins).

    Its only state is the run directory. On USR2 submitit calls `checkpoint`, which requeues this
    same object; the next start runs `run_job` again, which skips every bin whose arms' stores all
    exist and verify (a half-measured bin is measured again, whole), so no finished bin is recomputed.
    """

    def __init__(self, run_dir: str | Path, trusted=(), bins: list[int] | None = None):
        self.run_dir = str(Path(run_dir).resolve())
        self.trusted = list(trusted)  # builders the submitting user composed or named (see run.load_arms)
        self.bins = None if bins is None else list(bins)

    def __call__(self) -> str:
        run_dir, bins = Path(self.run_dir), getattr(self, "bins", None)
        which = "" if bins is None else f" (bins {', '.join(map(str, bins))})"
        print(f"twinrun: {_where()}: {run_dir}{which}; {_stores_done(run_dir)}", flush=True)
        try:
            return run_job(run_dir, getattr(self, "trusted", ()), bins)["status"]
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


def check(launcher: dict, probe_compile=False) -> None:
    """Refuse launcher settings that cannot work, naming the knob (ConfigError: exit 2).

    probe_compile: the run's probe.compile. For SLURM, asks sinfo about the partition and its GPUs;
    call it before planning to fail early.
    """
    name = launcher["name"]
    if name not in LAUNCHERS:
        raise ConfigError("launcher.name", name, f"choose one of {', '.join(LAUNCHERS)}")
    split = launcher.get("split", "pair")
    if split not in SPLITS:
        raise ConfigError("launcher.split", split, "choose pair (one job per run) or bins (one job per bin)")
    if split == "bins" and probe_compile:  # false/None: eager; "default"/"max-autotune": compiled
        # Concurrent elements would compile into one shared cache, each fingerprinting another cache
        # digest: every bin on its own kernel path, and the run refused as straddling.
        raise ConfigError("launcher.split", split, f"cannot run with probe.compile={probe_compile!r}: the bins' "
                          "jobs would share one compile cache and land on different kernel paths; use "
                          "launcher.split=pair, or probe.compile=false")
    if LAUNCHERS[name].cluster != "slurm" and launcher.get("constraint") is not None:
        raise ConfigError("launcher.constraint", launcher["constraint"], f"launcher={name} runs on this machine "
                          "and would ignore it: remove it, or use launcher=slurm")
    bad = unsafe_sbatch_knob(launcher, trusted=True)
    if bad is not None:
        raise ConfigError(f"launcher.{bad[0]}", bad[1], "may hold only letters, digits and _.,:@%+=|&()[]*- "
                          "(it becomes a line of the sbatch script)")
    LAUNCHERS[name].check(launcher)


def unsafe_sbatch_knob(launcher: dict, trusted: bool) -> tuple[str, object] | None:
    """(knob, value) of the first SLURM knob that could write a shell line into the sbatch script, or None.

    trusted (the user's own command line): additional_parameters' values may hold anything but a
    control character (e.g. `export: ALL,PATH=/opt/bin`); their keys must be SBATCH_WORD like the knobs."""
    for key in SBATCH_WORD_KNOBS:
        value = launcher.get(key)
        if value is not None and not (isinstance(value, str) and SBATCH_WORD.fullmatch(value)):
            return key, value
    for key, value in (launcher.get("additional_parameters") or {}).items():
        name = f"additional_parameters.{key}"
        if not (isinstance(key, str) and SBATCH_WORD.fullmatch(key)):
            return name, key
        text = value if isinstance(value, str) else str(value)
        allowed = not re.search(r"[\x00-\x1f\x7f]", text) if trusted else SBATCH_WORD.fullmatch(text)
        if not allowed:
            return name, value
    return None


def _check_in_process(launcher: dict) -> None:
    if launcher.get("split", "pair") != "pair":
        raise ConfigError("launcher.split", launcher["split"], "launcher=local measures in this process, bin "
                          "after bin; split=bins needs launcher=slurm (or submitit_local)")


def _check_submitit(launcher: dict) -> None:
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


def _check_slurm(launcher: dict) -> None:
    _check_submitit(launcher)
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
                             timeout=SCHEDULER_TIMEOUT_S)
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
    cluster = LAUNCHERS[launcher["name"]].cluster
    # max_num_timeout is a constructor argument, not an update_parameters one
    executor = submitit.AutoExecutor(folder=Path(folder_root).resolve() / launcher["folder"] / "%j",
                                     cluster=cluster,
                                     **{f"{cluster}_max_num_timeout": launcher["max_num_timeout"]})
    executor.update_parameters(**executor_parameters(launcher, cluster, job_name))
    return executor


class Element(NamedTuple):
    """One submitted job: the run directory it measures, its bins (None: every pending bin), the job."""
    run_dir: Path
    bins: list[int] | None
    job: object


def plan_elements(run_dirs: list[Path], split: str) -> list[tuple[Path, list[int] | None]]:
    """What each job will measure: a whole run (split=pair), or one pending bin of it (split=bins).

    A run whose every bin is already whole gets one whole-run job, which only marks it measured."""
    if split == "pair":
        return [(r, None) for r in run_dirs]
    out = []
    for run_dir in run_dirs:
        index = RunIndex.load(run_dir)
        whole = {b["index"] for b in index.whole_bins()}
        pending = [[b["index"]] for b in index.bins if b["index"] not in whole]
        out += [(run_dir, bins) for bins in pending] or [(run_dir, None)]
    return out


def submit(run_dirs: list[Path], launcher: dict, folder_root: Path, trusted=()) -> list[Element]:
    """One job per planned run directory (split=pair) or per pending bin (split=bins), all in one
    submission (one SLURM job array if several).

    Writes RUN_DIR/launch.json (job ids, cluster, log paths, time) and prints each job id.
    """
    check(launcher)
    planned = plan_elements([Path(r).resolve() for r in run_dirs], launcher.get("split", "pair"))
    folder_root = Path(folder_root)
    executor = make_executor(launcher, folder_root, f"twinrun-{folder_root.name}")
    with submitit.helpers.clean_env():  # submitting from inside an allocation must not inherit it
        try:
            with executor.batch():
                jobs = [executor.submit(PairJob(run_dir, trusted, bins)) for run_dir, bins in planned]
        except UncompletedJobError as err:  # sbatch refused the job
            raise _sbatch_refused(err, launcher) from None
    elements = [Element(run_dir, bins, job) for (run_dir, bins), job in zip(planned, jobs)]
    cluster = LAUNCHERS[launcher["name"]].cluster
    submitted = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    for run_dir in dict.fromkeys(e.run_dir for e in elements):
        _write_launch(run_dir, [e for e in elements if e.run_dir == run_dir], cluster, launcher, submitted)
    kind = "SLURM" if cluster == "slurm" else "submitit local"
    if len(jobs) > 1 and cluster == "slurm":
        print(f"twinrun: submitted {kind} job array {jobs[0].job_id.split('_')[0]} ({len(jobs)} "
              f"{'runs' if len(jobs) == len(run_dirs) else 'jobs'}; logs in {folder_root / launcher['folder']})",
              flush=True)
    for e in elements:
        which = "" if e.bins is None else f" bin {', '.join(map(str, e.bins))} of"
        print(f"twinrun: submitted {kind} job {e.job.job_id} for{which} {e.run_dir}", flush=True)
    return elements


def _write_launch(run_dir: Path, elements: list[Element], cluster: str, launcher: dict, submitted: str) -> None:
    """launch.json: the run's job (split=pair), or its first with every element listed (split=bins)."""
    path = RunDir(run_dir).launch_json
    earlier = []
    if path.is_file():  # a resubmission into the same run directory: keep the history
        old = read_json(path)
        earlier = old.pop("earlier", []) + [old]
    job = elements[0].job
    array_id, _, task = job.job_id.partition("_")
    record = {
        "format": LAUNCH_FORMAT,
        "cluster": cluster,
        **_job_record(job),
        "array_job_id": array_id if task else None,
        "array_task_id": int(task) if task else None,
        "submitted": submitted,
        "folder": str(job.paths.folder),
        "launcher": launcher,
        "earlier": earlier,
    }
    if elements[0].bins is not None:
        record["elements"] = [{"bins": e.bins, **_job_record(e.job)} for e in elements]
    write_json(path, record)


def _job_record(job) -> dict:
    return {"job_id": job.job_id, "stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr),
            "result": str(job.paths.result_pickle)}


# ----------------------------------------------------------------------------- wait


def wait(elements: list[Element], launcher: dict) -> dict[Path, int]:
    """Block until every job has ended, printing state and bins done as they change.

    Returns {run_dir: exit code} for the runs with a failed job (the worst of its elements; 1: an arm
    failed, run.json names it; 4: the model raised; 2: the job died or failed otherwise), after
    printing the error's tail, named by run and bin; the rest measured.
    """
    pending = dict(enumerate(elements))
    shown: dict[int, str] = {}
    failed: dict[Path, int] = {}
    stuck_since: dict[int, float] = {}
    try:
        while pending:
            for key, (ended, state) in _poll({k: e.job for k, e in pending.items()}).items():
                e = pending[key]
                if _stuck(key, state, stuck_since):
                    pending.pop(key)
                    _fail(failed, e.run_dir, _cancel_stuck(_label(e), e.job, state))
                    continue
                line = status.describe(e.run_dir, status.progress(e.run_dir), state)
                line = line if e.bins is None else f"bin {', '.join(map(str, e.bins))}: {line}"
                if shown.get(key) != line:
                    print(f"twinrun: {line}", flush=True)
                    shown[key] = line
                if ended:
                    code = _outcome(pending.pop(key), state)
                    if code is not None:
                        _fail(failed, e.run_dir, code)
            if pending:
                time.sleep(launcher["poll_s"])
    except KeyboardInterrupt:
        where = " ".join(str(r) for r in dict.fromkeys(e.run_dir for e in pending.values()))
        print(f"\ntwinrun: stopped waiting; the jobs keep running. Follow them with "
              f"`python -m twinrun.status {where}`, then reduce with `python -m twinrun.reduce RUN_DIR`",
              file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    return failed


def _fail(failed: dict, run_dir: Path, code: int) -> None:
    failed[run_dir] = max(code, failed.get(run_dir, code))


def _label(e: Element) -> str:
    return str(e.run_dir) if e.bins is None else f"{e.run_dir} bin {', '.join(map(str, e.bins))}"


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
    print(f"twinrun: error: {label}: job {job.job_id} cancelled: it was {state}, which waiting cannot "
          f"resolve; change launcher.{UNRESOLVABLE[reason].replace(', ', ', launcher.').replace(' or ', ' or launcher.')} "
          "to fit the partition and resume", file=sys.stderr, flush=True)
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


def _outcome(e: Element, state: str) -> int | None:
    """None if the job measured its bins; else print why (with the error's tail) and return its exit code."""
    job = e.job
    if job.paths.result_pickle.exists():
        try:
            job.result()
        except UncompletedJobError as err:
            return _report(e, _final_state(job, state), _trace_tail(str(err)))
        index = RunIndex.load(e.run_dir)
        mine = [b for b in index.bins if e.bins is None or b["index"] in e.bins]
        if all(index.marked_done(b) for b in mine):
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
        if queued in SLURM_ENDED or queued == GONE or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    accounted = sacct_state(job.job_id)
    if accounted and accounted.split()[0] in SLURM_ENDED:
        return accounted
    return queued


def _own_failure(e: Element) -> dict | None:
    """The failure run.json records at this element's bins (never another element's), or None."""
    index = RunIndex.load(e.run_dir)
    failure = index.doc.get("failure")
    if e.bins is None:
        return failure
    for b in index.bins:
        if b["index"] in e.bins:
            for entry in b["stores"].values():
                if entry.get("failure"):
                    return entry["failure"]
    # (a run.json written before stores recorded their own failure: the run's latest, if it is ours)
    return failure if failure and failure["bin_index"] in e.bins else None


def _report(e: Element, state: str, tail: list[str]) -> int:
    failure = _own_failure(e)
    where = (f"arm {failure['arm']} failed at bin {failure['bin_index']} (σ={failure['sigma']:g})"
             if failure else "the job failed")
    print(f"twinrun: error: {_label(e)}: job {e.job.job_id} {state}: {where}; finished bins are kept "
          "(submit the same run directory again to resume)", file=sys.stderr)
    for line in tail:
        print(f"  | {line}", file=sys.stderr)
    print(f"  logs: {e.job.paths.stderr}", file=sys.stderr, flush=True)
    if failure and failure.get("type"):  # the model raised (run.json records its exception): exit 4
        return EXIT_MODEL
    if failure and failure.get("refused") == "kernel_path":  # the job refused to straddle kernel paths
        return EXIT_REFUSED
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


# ----------------------------------------------------------------------------- the scheduler's word


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


def _slurm_state(job: dict) -> str:
    """A SLURM job's state as well as it can be told: squeue while it is known, then sacct."""
    job_id, finished = job["job_id"], Path(job["result"]).exists()
    states = slurm_states([job_id])
    state = None if states is None else states[job_id]
    if state is not None and state != GONE and state not in SLURM_ENDED:
        return state
    return sacct_state(job_id) or state or ("ENDED" if finished else "UNKNOWN")


def _local_state(job: dict) -> str:
    """submitit's local executor: the job id is its controller's pid."""
    from twinrun.lock import pid_alive

    if Path(job["result"]).exists():
        return "ENDED"
    return "RUNNING" if pid_alive(int(job["job_id"])) else "ENDED WITHOUT RESULT"


def job_state(launch: dict | None) -> str | None:
    """The state of the job(s) launch.json names: the job's, or for a run split by bins the most
    active element's, followed by every element's ("RUNNING (bin 0 COMPLETED 0:0, bin 1 RUNNING)")."""
    if launch is None:
        return None
    state = next(l for l in LAUNCHERS.values() if l.cluster == launch["cluster"]).state
    elements = launch.get("elements")
    if not isinstance(elements, list) or not elements:
        return state(launch)
    each = [(e.get("bins"), state(e)) for e in elements]
    active = [s for _, s in each if s.split()[0] in ACTIVE]
    head = (active or [each[0][1]])[0].split()[0]
    return f"{head} ({', '.join(f'bin {_bins_text(b)} {s}' for b, s in each)})"


def _bins_text(bins) -> str:
    return ", ".join(map(str, bins)) if isinstance(bins, list) else "?"


# ----------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Launcher:
    """One launcher: where its jobs run, how its settings are checked, how a job's state is told."""
    cluster: str | None  # submitit's cluster name; None: measured in the calling process, no job
    check: Callable[[dict], None]  # raises ConfigError naming the knob
    state: Callable[[dict], str] | None  # the state of a job record of launch.json

    @property
    def in_process(self) -> bool:
        return self.cluster is None


LAUNCHERS = {
    "local": Launcher(cluster=None, check=_check_in_process, state=None),
    "submitit_local": Launcher(cluster="local", check=_check_submitit, state=_local_state),
    "slurm": Launcher(cluster="slurm", check=_check_slurm, state=_slurm_state),
}
