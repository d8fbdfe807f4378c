"""The launchers that run on this machine: `local` (in this process) and `submitit_local` (the same
pickled job SLURM runs, as a local subprocess whose job id is its controller's pid)."""

from pathlib import Path

from twinrun.errors import ConfigError
from twinrun.storage.lock import pid_alive


def check_in_process(launcher: dict) -> None:
    if launcher.get("split", "pair") != "pair":
        raise ConfigError("launcher.split", launcher["split"], "launcher=local measures in this process, bin "
                          "after bin; split=bins needs launcher=slurm (or submitit_local)")


def check_submitit(launcher: dict) -> None:
    if launcher["nodes"] != 1:
        raise ConfigError("launcher.nodes", launcher["nodes"], "must be 1: both arms of a pair run in one "
                          "process, so more nodes would idle (a sweep runs its points as a job array)")
    for key, low in (("timeout_min", 1), ("cpus_per_task", 1), ("gpus_per_node", 0), ("signal_delay_s", 0),
                     ("max_num_timeout", 0), ("array_parallelism", 1)):
        if launcher[key] is None:  # only launcher=slurm reads a null from the partition (before this)
            raise ConfigError(f"launcher.{key}", None, f"must be a number ≥ {low} with launcher="
                              f"{launcher['name']} (null is read from the partition by launcher=slurm)")
        if launcher[key] < low:
            raise ConfigError(f"launcher.{key}", launcher[key], f"must be ≥ {low}")
    if launcher["mem_gb"] is not None and launcher["mem_gb"] <= 0:
        raise ConfigError("launcher.mem_gb", launcher["mem_gb"],
                          "must be > 0, or null for the cluster's default")
    if not launcher["poll_s"] > 0:
        raise ConfigError("launcher.poll_s", launcher["poll_s"], "must be > 0 seconds")


def local_state(job: dict) -> str:
    """submitit's local executor: the job id is its controller's pid."""
    if Path(job["result"]).exists():
        return "ENDED"
    return "RUNNING" if pid_alive(int(job["job_id"])) else "ENDED WITHOUT RESULT"
