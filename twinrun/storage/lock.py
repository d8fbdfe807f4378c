"""One writer per run directory (or per unit): flocks on RUN_DIR/.lock that name their holder.

A job measuring the whole run holds RUN_DIR/.lock exclusively. The array elements of a run split by
units (launcher.split=bins) hold it shared, so they run side by side but never beside a whole-run
job, and each holds RUN_DIR/.lock-unit<k> exclusively for its unit. Every change of run.json is one
read-modify-write under RUN_DIR/.run.json.lock (`update_lock`), so concurrent elements never lose
each other's records.

The kernel grants the flock to one open descriptor at a time and drops it when the holder dies,
so acquisition is atomic and a dead writer never blocks the next one; the file is never deleted
(deleting it would let a second writer lock a new file while the first still holds the old one).
While held, the file records the holder (pid, host, boot id, SLURM job); it is emptied on release.
So a non-empty file whose flock we obtain was left by a writer that died: on this host (the
kernel released its flock) it is recovered with a message. One left on another host is refused,
because a file system shared between hosts may keep flocks per host; unless it is our own SLURM
job's previous incarnation (SLURM requeues a job only after it is gone).
"""

import contextlib
import fcntl
import json
import os
import socket
import stat
import time
from contextlib import contextmanager
from pathlib import Path

from twinrun.errors import StoreError

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
# An update holds its lock for one read and one atomic write of run.json (milliseconds): waiting
# this long means a hung file system or a stopped process, which is reported, never waited out.
UPDATE_TIMEOUT_S = 60.0
UPDATE_POLL_S = 0.002


def boot_id() -> str | None:
    try:
        return BOOT_ID_PATH.read_text().strip()
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": boot_id(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID")}


def holder_alive(holder: dict | None) -> bool | None:
    """Whether a recorded holder still runs: True/False on this host, None when it cannot be told here."""
    if not holder:
        return False
    if holder.get("host") != socket.gethostname():
        return None
    if holder.get("boot_id") is not None and holder.get("boot_id") != boot_id():
        return False  # a pid from before a reboot names nobody (or a stranger)
    pid = holder.get("pid")
    return type(pid) is int and pid > 0 and pid_alive(pid)


def read_holder(path: Path) -> dict | None:
    """The holder recorded in a lock file (None if empty, absent or not a holder record)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _parse_holder(os.pread(fd, 4096, 0))
    finally:
        os.close(fd)


def _parse_holder(data: bytes) -> dict | None:
    try:
        holder = json.loads(data.decode())
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        return None
    return holder if isinstance(holder, dict) else None


def _open(path: Path) -> int:
    """The lock file, opened (created if absent) without following a link, and only if it is the run
    directory's own: a regular file with one link. A holder record is written into it and it is emptied on
    release, so a hard link planted at its name would have another file emptied."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise StoreError(path, f"cannot open the run lock ({err.strerror}); "
                         "finished stores are kept") from None
    st = os.fstat(fd)
    problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode)
               else f"has {st.st_nlink} links (a hard link to a file elsewhere)" if st.st_nlink != 1
               else None)
    if problem is not None:
        os.close(fd)  # never locked, never emptied: the file it links to stays as it was
        raise StoreError(path, f"the run lock {problem}: it is not the run's own file; remove it and run "
                         "again")
    return fd


def _acquire(path: Path, mode: int = fcntl.LOCK_EX, what=None) -> int:
    """An open descriptor holding the flock (exclusive, or LOCK_SH) on `path`, or a StoreError naming
    the holder (and `what` is held: the lock's file, or the run directory it stands for)."""
    while True:
        fd = _open(path)
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _parse_holder(os.pread(fd, 4096, 0)) or {}
            os.close(fd)
            where = "this host" if holder.get("host") == socket.gethostname() else holder.get("host", "?")
            raise StoreError(what or path, f"is being written by pid {holder.get('pid', '?')} on {where}; "
                             "wait for it or stop it") from None
        except OSError as err:
            os.close(fd)
            raise StoreError(path, f"cannot lock ({err.strerror}): "
                             "the file system must support flock") from None
        try:
            same_file = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:
            return fd
        os.close(fd)  # someone removed or replaced the file between our open and our flock: again


def _take_over(path: Path, fd: int, mine: dict) -> None:
    """We hold the flock: decide about a record left behind, then write ours."""
    left = os.pread(fd, 4096, 0)
    holder = _parse_holder(left)
    requeued = holder is not None and mine["slurm_job_id"] is not None \
        and holder.get("slurm_job_id") == mine["slurm_job_id"]
    if holder is not None and holder.get("host") != mine["host"] and not requeued:
        raise StoreError(path.parent, f"was being written by pid {holder.get('pid')} on "
                         f"{holder.get('host')}, which did not release it; if that job is gone, "
                         f"remove {path} and run again")
    if left.strip():
        who = f"pid {holder.get('pid')} on {holder.get('host')}" if holder else "an unreadable record"
        print(f"twinrun: recovering the stale lock {path} ({who}; its holder is gone)", flush=True)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        os.fsync(fd)
    except OSError as err:
        raise StoreError(path, f"cannot write the run lock ({err.strerror}); "
                         "finished stores are kept") from None


@contextmanager
def run_lock(lock: Path, unit_locks: list[Path], shared: bool):
    """Hold the run for the block: its `lock` exclusively and every unit lock exclusively, or (shared:
    an array element of launcher.split=bins) `lock` shared and the element's unit locks exclusively.

    The whole-run job takes the unit locks too, recording itself in each: elements record no holder
    in the shared lock, so across hosts (flocks per host) only their unit locks' records meet it."""
    with contextlib.ExitStack() as stack:
        if shared:
            fd = _acquire(lock, fcntl.LOCK_SH, lock.parent)  # shared: records no holder (the unit locks do)
            stack.callback(os.close, fd)
        else:
            stack.enter_context(_held(lock, lock.parent))
        for path in unit_locks:
            stack.enter_context(_held(path))
        yield


@contextmanager
def _held(path: Path, what=None):
    """Hold `path` exclusively, with our holder record in it, for the duration of the block."""
    fd = _acquire(path, what=what)
    try:
        _take_over(path, fd, me())
    except BaseException:
        os.close(fd)
        raise
    try:
        yield
    finally:
        try:
            os.ftruncate(fd, 0)  # released by its holder: nothing left to recover
        except OSError:
            pass  # a read-only or full file system: the next writer recovers the record with a message
        os.close(fd)  # closing the last descriptor releases the flock


@contextmanager
def update_lock(path: Path, timeout_s: float = UPDATE_TIMEOUT_S):
    """Hold `path` exclusively for one short read-modify-write, waiting for the current holder (an
    update by another process) up to `timeout_s`, then a StoreError: no writer waits forever."""
    fd = _open(path)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StoreError(path, f"still locked by another update after {timeout_s:g} s (a stopped "
                                     "process or a hung file system?); finished stores are kept") from None
                time.sleep(UPDATE_POLL_S)
            except OSError as err:
                raise StoreError(path, f"cannot lock ({err.strerror}): "
                                 "the file system must support flock") from None
        yield
    finally:
        os.close(fd)  # releases the flock
