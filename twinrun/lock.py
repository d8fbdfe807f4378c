"""One writer per run directory: RUN_DIR/.lock holds the writer's pid and host.

A lock left by a dead process on this host is recovered with a message; a live one (or one from
another host, which cannot be checked from here) refuses the second writer.
"""

import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path

from twinrun.errors import StoreError

LOCK_NAME = ".lock"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _try_create(path: Path, owner: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError as err:
        raise StoreError(path.parent, f"cannot write here ({err.strerror}); finished stores are kept") from None
    with os.fdopen(fd, "w") as f:
        json.dump(owner, f)
    return True


@contextmanager
def run_lock(run_dir: Path):
    """Hold RUN_DIR/.lock for the duration of the block."""
    path = Path(run_dir) / LOCK_NAME
    me = {"pid": os.getpid(), "host": socket.gethostname(), "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
    if not _try_create(path, me):
        try:
            holder = json.loads(path.read_text())
            pid, host = int(holder["pid"]), str(holder["host"])
        except (OSError, ValueError, KeyError, TypeError):
            holder, pid, host = None, -1, ""
        # SLURM requeues a job only after its previous incarnation is gone, possibly to another
        # node: a lock left by the same job id is that dead incarnation's.
        requeued = holder is not None and me["slurm_job_id"] is not None \
            and holder.get("slurm_job_id") == me["slurm_job_id"]
        if holder is not None and host != me["host"] and not requeued:
            raise StoreError(run_dir, f"is being written by pid {pid} on {host}; if that job is gone, "
                             f"remove {path} and run again")
        if holder is not None and not requeued and pid_alive(pid):
            raise StoreError(run_dir, f"is being written by pid {pid} on this host; wait for it or stop it")
        print(f"twinrun: recovering the stale lock {path} (pid {pid} on {host or '?'} is gone)", flush=True)
        path.unlink(missing_ok=True)
        if not _try_create(path, me):
            raise StoreError(run_dir, "another process took the lock at the same moment; run again")
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
