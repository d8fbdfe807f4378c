"""One writer per run directory (or per bin): flocks on RUN_DIR/.lock that name their holder.

A job measuring the whole run holds RUN_DIR/.lock exclusively. The array elements of a run split by
bins (launcher.split=bins) hold it shared, so they run side by side but never beside a whole-run
job, and each holds RUN_DIR/.lock-bin<k> exclusively for its bin. Every change of run.json is one
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
import re
import socket
import stat
import time
from contextlib import contextmanager
from pathlib import Path

from twinrun.errors import StoreError
from twinrun.rundir import RunDir

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


def read_holder(run_dir, path: Path | None = None) -> dict | None:
    """The holder recorded in RUN_DIR/.lock, or in the lock file `path` (a bin's) of it (None if empty,
    absent or not a holder record)."""
    path = RunDir(run_dir).lock if path is None else path
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
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return holder if isinstance(holder, dict) else None


def _open(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise StoreError(path, f"cannot open the run lock ({err.strerror}); finished stores are kept") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StoreError(path, "the run lock is not a regular file; remove it and run again")
    return fd


def _acquire(path: Path, mode: int = fcntl.LOCK_EX) -> int:
    """An open descriptor holding the flock (exclusive, or LOCK_SH) on `path`, or a StoreError naming
    the holder."""
    while True:
        fd = _open(path)
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _parse_holder(os.pread(fd, 4096, 0)) or {}
            os.close(fd)
            where = "this host" if holder.get("host") == socket.gethostname() else holder.get("host", "?")
            what = path.parent if path.name == RunDir(path.parent).lock.name else path
            raise StoreError(what, f"is being written by pid {holder.get('pid', '?')} on {where}; "
                             "wait for it or stop it") from None
        except OSError as err:
            os.close(fd)
            raise StoreError(path, f"cannot lock ({err.strerror}): the file system must support flock") from None
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
        raise StoreError(path.parent, f"was being written by pid {holder.get('pid')} on {holder.get('host')}, "
                         f"which did not release it; if that job is gone, remove {path} and run again")
    if left.strip():
        who = f"pid {holder.get('pid')} on {holder.get('host')}" if holder else "an unreadable record"
        print(f"twinrun: recovering the stale lock {path} ({who}; its holder is gone)", flush=True)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        os.fsync(fd)
    except OSError as err:
        raise StoreError(path, f"cannot write the run lock ({err.strerror}); finished stores are kept") from None


@contextmanager
def run_lock(run_dir: Path, bins: list[int] | None = None):
    """Hold the run for the block: RUN_DIR/.lock and every bin's RUN_DIR/.lock-bin<k> exclusively, or
    with `bins` (an array element's bins) RUN_DIR/.lock shared and each of those bins' locks exclusively.

    The whole-run job takes the bin locks too, recording itself in each: elements record no holder in
    the shared .lock, so across hosts (flocks per host) only their bin locks' records meet it."""
    rd = RunDir(run_dir)
    if bins is None:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_held(rd.lock))
            for index in _every_bin(rd):
                stack.enter_context(_held(rd.bin_lock(index)))
            yield
        return
    with contextlib.ExitStack() as stack:
        fd = _acquire(rd.lock, fcntl.LOCK_SH)  # shared: records no holder (the bin locks do)
        stack.callback(os.close, fd)
        for index in sorted(set(bins)):
            stack.enter_context(_held(rd.bin_lock(index)))
        yield


def _every_bin(rd: RunDir) -> list[int]:
    """The run's bins (run.json's, if readable) and any bin whose lock file an element left."""
    from twinrun.store import read_json

    pattern = re.compile(re.escape(rd.lock.name) + r"-bin([0-9]{3,6})")
    found = {int(m.group(1)) for p in rd.path.glob(f"{rd.lock.name}-bin*") if (m := pattern.fullmatch(p.name))}
    if rd.is_run():
        try:
            found.update(range(len(read_json(rd.run_json)["bins"])))
        except StoreError:
            pass  # a damaged run.json is refused by whoever reads it next, with its own message
    return sorted(found)


@contextmanager
def _held(path: Path):
    """Hold `path` exclusively, with our holder record in it, for the duration of the block."""
    fd = _acquire(path)
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
                raise StoreError(path, f"cannot lock ({err.strerror}): the file system must support flock") from None
        yield
    finally:
        os.close(fd)  # releases the flock
