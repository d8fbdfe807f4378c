"""The SLURM backend: its knobs and their guard, the partition checks, and the scheduler's word on a job.

submitit writes each SLURM knob into the sbatch script as `#SBATCH --key=value`, so every knob that
could carry a shell line is held to SBATCH_WORD; sinfo is asked before submission whether the job
can ever run (partition, GPUs, CPUs, memory, time); squeue (no accounting needed) and sacct tell a
job's state, never submitit's cached state alone.
"""

import re
import shutil
import subprocess
from pathlib import Path

from twinrun.errors import ConfigError
from twinrun.launchers.local import check_submitit

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


DEFAULT_CPUS_PER_RUN = 4  # cpus_per_task left null on a partition whose nodes have at least this many


def check_slurm(launcher: dict) -> None:
    """Every resource problem of the submission against sinfo's partitions, reported at once in one line
    (ConfigError naming the first knob, the others after it), before anything is submitted."""
    check_submitit(launcher)
    partitions = _answering()
    problems, partition, nodes = _partition(launcher, partitions)
    problems += _time_problems(launcher)
    if nodes:
        problems += _gpu_problems(launcher, partition, nodes) + _fit_problems(launcher, partition, nodes)
    if problems:
        (key, value, fix), rest = problems[0], problems[1:]
        more = "".join(f"; and {k}={v!r}: {f}" for k, v, f in rest)
        raise ConfigError(key, value, fix + more)


def fill_from_partition(launcher: dict) -> None:
    """The knobs launcher=slurm leaves null, read from the partition the job goes to (sinfo), in place:
    gpus_per_node one per run where its nodes have GPUs, else 0 (a CPU-only cluster asks for none);
    cpus_per_task DEFAULT_CPUS_PER_RUN, or what the largest node has per run of a pack if fewer. Unknown
    partitions leave them for check_slurm to report (with the others)."""
    if launcher.get("gpus_per_node") is not None and launcher.get("cpus_per_task") is not None:
        return
    _, _, nodes = _partition(launcher, _answering())
    pack = launcher.get("pack", 1) or 1
    if launcher.get("gpus_per_node") is None:
        launcher["gpus_per_node"] = pack if any("gpu" in n["gres"] for n in nodes) else 0
    if launcher.get("cpus_per_task") is None:
        most = max((n["cpus"] for n in nodes if n["cpus"] is not None), default=None)
        launcher["cpus_per_task"] = max(1, min(DEFAULT_CPUS_PER_RUN, (most or DEFAULT_CPUS_PER_RUN) // pack))


def _answering() -> dict[str, list[dict]]:
    if shutil.which("sbatch") is None:
        raise ConfigError("launcher", "slurm", "sbatch is not on PATH: run where SLURM is installed (a local "
                          "test cluster: `bash launch/slurm-up.sh`), or use launcher=local or submitit_local")
    return _sinfo()


def _partition(launcher: dict, partitions: dict) -> tuple[list, str | None, list[dict]]:
    """(problems, the partition the job goes to, its nodes): the one named, else the cluster's default;
    a name the cluster lacks is a problem, and the rest is then judged against the default, if any."""
    names = [p.rstrip("*") for p in partitions]
    default = next((p.rstrip("*") for p in partitions if p.endswith("*")), None)
    partition, problems = launcher["partition"], []
    if partition is None and default is None:
        fix = f"this cluster has no default partition; choose one of {', '.join(names)}"
        problems.append(("launcher.partition", None, fix))
    elif partition is not None and partition not in names:
        fix = f"no such partition on this cluster; choose one of {', '.join(names)}"
        problems.append(("launcher.partition", partition, fix))
        partition = default
    else:
        partition = partition or default
    nodes = [n for p, ns in partitions.items() if p.rstrip("*") == partition for n in ns]
    return problems, partition, nodes


def _time_problems(launcher: dict) -> list[tuple]:
    timeout_min, delay_s = launcher["timeout_min"], launcher["signal_delay_s"]
    if timeout_min * 60 > delay_s + CHECKPOINT_MARGIN_S:
        return []
    least = (delay_s + CHECKPOINT_MARGIN_S) // 60 + 1
    fix = (f"leaves no time to run: the job is signalled launcher.signal_delay_s={delay_s} s before the "
           f"limit and needs {CHECKPOINT_MARGIN_S} s more to requeue; use timeout_min ≥ {least} or a "
           "smaller signal_delay_s")
    return [("launcher.timeout_min", timeout_min, fix)]


def _gpu_problems(launcher: dict, partition: str, nodes: list[dict]) -> list[tuple]:
    gres = {n["gres"] for n in nodes}
    if launcher["gpus_per_node"] > 0 and not any("gpu" in g for g in gres):
        fix = (f"partition {partition} has no GPUs (sinfo gres: {', '.join(sorted(gres))}); use "
               "launcher.gpus_per_node=0 to run on CPUs (or leave it null: read from the partition), or a "
               "GPU partition")
        return [("launcher.gpus_per_node", launcher["gpus_per_node"], fix)]
    return []


def _fit_problems(launcher: dict, partition: str, nodes: list[dict]) -> list[tuple]:
    """CPUs, memory and time asked for must fit some node of the partition, else the job would pend
    forever (PartitionConfig). A pack's job asks for pack × cpus_per_task and pack × mem_gb."""
    pack = launcher.get("pack", 1) or 1
    per = f" per run × launcher.pack={pack}" if pack > 1 else ""
    problems = []
    most_cpus = max((n["cpus"] for n in nodes if n["cpus"] is not None), default=None)
    if most_cpus is not None and launcher["cpus_per_task"] * pack > most_cpus:
        fix = (f"partition {partition}'s largest node has {most_cpus} CPUs; ask for at most "
               f"{max(most_cpus // pack, 1)}{per}")
        problems.append(("launcher.cpus_per_task", launcher["cpus_per_task"], fix))
    most_mb = max((n["mem_mb"] for n in nodes if n["mem_mb"] is not None), default=None)
    if most_mb is not None and launcher["mem_gb"] is not None and launcher["mem_gb"] * pack * 1024 > most_mb:
        fix = (f"partition {partition}'s largest node has {most_mb / 1024:.1f} GB; ask for at most "
               f"{most_mb / 1024 / pack:.1f}{per} (or null for the cluster's default)")
        problems.append(("launcher.mem_gb", launcher["mem_gb"], fix))
    limits = [n["limit_min"] for n in nodes]
    if limits and None not in limits and launcher["timeout_min"] > max(limits):
        fix = (f"partition {partition}'s time limit is {max(limits)} min; ask for at most that (the job "
               "checkpoints and requeues itself at the limit)")
        problems.append(("launcher.timeout_min", launcher["timeout_min"], fix))
    return problems


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
        out = subprocess.run(["sinfo", "-h", "-o", "%P|%G|%c|%m|%l"], check=False, capture_output=True,
                             text=True, timeout=SCHEDULER_TIMEOUT_S)
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
            {"gres": gres.strip(), "cpus": _number(cpus), "mem_mb": _number(mem),
             "limit_min": _minutes(limit.strip())})
    return partitions


def sbatch_refused(err: Exception, launcher: dict) -> ConfigError:
    """sbatch's refusal as a one-line error naming the knob it most likely concerns."""
    lines = [line.removeprefix("sbatch: error: ") for line in str(err).strip().splitlines()] or [str(err)]
    said = "; ".join(lines)
    for word, knob in SBATCH_KNOBS:
        if word in said.lower():
            return ConfigError(f"launcher.{knob}", launcher[knob], f"sbatch refused the job: {said}")
    return ConfigError("launcher.additional_parameters", launcher["additional_parameters"],
                       f"sbatch refused the job: {said}")


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


def slurm_state(job: dict) -> str:
    """A SLURM job's state as well as it can be told: squeue while it is known, then sacct."""
    job_id, finished = job["job_id"], Path(job["result"]).exists()
    states = slurm_states([job_id])
    state = None if states is None else states[job_id]
    if state is not None and state != GONE and state not in SLURM_ENDED:
        return state
    return sacct_state(job_id) or state or ("ENDED" if finished else "UNKNOWN")
