"""Where a number was computed, recorded as `info` and never compared: the GPUs' UUIDs and driver, the
SLURM ids, the checkout's commit (a requeue onto an identical node is the same kernel path)."""

import shutil
import subprocess
from pathlib import Path

import torch

SLURM_ENV = (
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_NODEID",
    "SLURMD_NODENAME",
    "SLURM_RESTART_COUNT",
)


def _gpu_uuids() -> list | None:
    if not torch.cuda.is_available():
        return None
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def _gpu_uuid(device: torch.device | None) -> str | None:
    if device is None or device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def _nvidia_smi() -> list | None:
    """Every GPU on the node (not only the visible ones) with its UUID and driver; None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    query = "--query-gpu=index,uuid,driver_version,name"
    try:
        out = subprocess.run(
            [exe, query, "--format=csv,noheader"], check=False, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    rows = [[field.strip() for field in line.split(",")] for line in out.stdout.strip().splitlines()]
    return [dict(zip(("index", "uuid", "driver_version", "name"), row)) for row in rows if len(row) == 4]


def _git_state() -> dict:
    """Commit and dirty state of the checkout holding this package; nulls outside a git checkout."""
    package = Path(__file__).resolve().parent.parent
    state = {"commit": None, "dirty": None}

    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(
                ["git", "-C", str(package.parent), *args],
                check=False,
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None

    top = git("rev-parse", "--show-toplevel")
    if top is None or top.returncode != 0:
        return state
    # An install inside an ignored venv of some other checkout is not that checkout's source.
    ignored = git("check-ignore", "-q", str(package))
    if ignored is None or ignored.returncode == 0:
        return state
    head = git("rev-parse", "HEAD")  # fails in a repository with no commits yet
    if head is not None and head.returncode == 0:
        state["commit"] = head.stdout.strip()
    status = git("status", "--porcelain")
    if status is not None and status.returncode == 0:
        state["dirty"] = bool(status.stdout.strip())
    return state
