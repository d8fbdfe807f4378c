"""The run lock: never two holders, whatever the race, a dead holder never blocks, a reused pid neither."""

import json
import os
import socket
import time

import pytest
from rundirs import job_lock

from twinrun.errors import StoreError
from twinrun.storage.lock import holder_alive, read_holder

N_RACERS = 200


def _race(run_dir, log) -> int:
    """Fork N_RACERS processes released at one instant; each tries the lock twice and logs enter/exit."""
    r, w = os.pipe()
    children = []
    for _ in range(N_RACERS):
        pid = os.fork()
        if pid == 0:  # child: wait for the start signal, race, never return into pytest
            code = 0
            try:
                os.close(w)
                os.read(r, 1)
                for _ in range(2):
                    try:
                        with job_lock(run_dir):
                            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                            os.write(fd, f"enter {os.getpid()}\n".encode())
                            time.sleep(0.002)
                            os.write(fd, f"exit {os.getpid()}\n".encode())
                            os.close(fd)
                    except StoreError:
                        pass
            except BaseException:  # noqa: BLE001 — anything else is a failure the parent must see
                code = 1
            os._exit(code)
        children.append(pid)
    os.close(r)
    os.close(w)  # every child's read returns now
    codes = [os.waitpid(pid, 0)[1] for pid in children]
    assert all(c == 0 for c in codes), "a racer raised something other than the refusal"
    return _max_overlap(log)


def _max_overlap(log) -> int:
    held, most, entries = 0, 0, 0
    for line in log.read_text().splitlines():
        held += 1 if line.startswith("enter") else -1
        entries += line.startswith("enter")
        most = max(most, held)
    assert entries >= 1, "nobody ever got the lock"
    return most


@pytest.mark.parametrize("left_behind", [None, "dead_pid", "garbage", "half_written"])
def test_200_forked_racers_never_hold_the_lock_together(tmp_path, left_behind):
    run_dir, log = tmp_path / "run", tmp_path / "log"
    run_dir.mkdir()
    if left_behind == "dead_pid":
        (run_dir / ".lock").write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    elif left_behind == "garbage":
        (run_dir / ".lock").write_bytes(b"\x00\xffnot a lock")
    elif left_behind == "half_written":
        (run_dir / ".lock").write_text('{"pid": 12')
    assert _race(run_dir, log) == 1
    assert (run_dir / ".lock").read_text() == ""  # the last holder released it cleanly


def _dead_pid() -> int:
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    return child


def test_a_pid_from_before_a_reboot_is_not_alive(monkeypatch):
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    assert holder_alive(me) is True
    assert holder_alive({**me, "boot_id": "another-boot"}) is False
    assert holder_alive({**me, "host": "elsewhere"}) is None
    assert holder_alive(None) is False


def test_a_pid_from_before_a_reboot_does_not_block(tmp_path, capsys):
    # our own (live) pid, recorded in an earlier boot: the kernel holds no flock for it, so it is taken
    (tmp_path / ".lock").write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(),
                                                "boot_id": "an-earlier-boot"}))
    with job_lock(tmp_path):
        assert read_holder(tmp_path / ".lock")["pid"] == os.getpid()
    assert "recovering the stale lock" in capsys.readouterr().out


def test_the_lock_file_is_never_deleted_and_a_fifo_is_refused(tmp_path):
    with job_lock(tmp_path):
        pass
    assert (tmp_path / ".lock").is_file()
    (tmp_path / ".lock").unlink()
    os.mkfifo(tmp_path / ".lock")
    with pytest.raises(StoreError, match="not a regular file"), job_lock(tmp_path):
        pass
