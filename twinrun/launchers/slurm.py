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


def check_slurm(launcher: dict) -> None:
    check_submitit(launcher)
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
                          f"partition {partition}'s largest node has {most_mb / 1024:.1f} GB; ask for at "
                          "most that (or null for the cluster's default)")
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
