"""Stores: atomic, checked, safe to load; damage is a named error, never a number or traceback."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rundirs import job_lock
from stores import write_sums

from twinrun.errors import StoreError
from twinrun.files import read_json, write_json
from twinrun.measures.probe import fold_tensors
from twinrun.storage.store import STORE_FORMAT, TENSOR_SHA256, read_store

LAYOUT = [{"name": "w", "offset": 0, "numel": 6, "shape": [2, 3], "cond": False},
          {"name": "c", "offset": 6, "numel": 2, "shape": [2], "cond": True}]
META = {"arm": "native", "bin_index": 0, "sigma": 0.5, "sigma_cond": 0.5, "n_images": 6, "n_draws": 2,
        "fold_sizes": [2, 2, 2], "draws_digest": "ab" * 32, "config_hash": "0123456789abcdef",
        "layout": LAYOUT}


def real_store(tmp_path):
    path = tmp_path / "bin00_sigma0.5.safetensors"
    sums = torch.arange(24, dtype=torch.float32).reshape(3, 8) / 7
    return path, sums, write_sums(path, sums, META)


def test_round_trip_and_metadata(tmp_path):
    path, sums, sha = real_store(tmp_path)
    store = read_store(path, sha)
    assert torch.equal(store.sums, sums) and store.meta["layout"] == LAYOUT and store.meta["sigma"] == 0.5
    assert not list(tmp_path.glob(".*tmp*")), "the temporary file is renamed into place"


@pytest.mark.parametrize("config_hash", ["9120e71234567890", "1234567890123456", "00000000000000e0"])
def test_a_string_that_reads_as_a_json_number_comes_back_a_string(tmp_path, config_hash):
    # A config hash of digits and one 'e' is a JSON number too: it came back as 9.12e+74 (or inf) and
    # the store was refused as damaged (a run hit one in CI).
    path = tmp_path / "bin00_sigma0.5.safetensors"
    sha = write_sums(path, torch.ones(3, 8), {**META, "config_hash": config_hash})
    assert read_store(path, sha).meta["config_hash"] == config_hash


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing", "wrong_dtype", "wrong_shape", "foreign"])
def test_damage_is_a_named_store_error(tmp_path, damage):
    path, sums, sha = real_store(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[-5] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "missing":
        path.unlink()
    elif damage == "wrong_dtype":
        # float64 tensors through safetensors itself, each with its valid digest: only the dtype is wrong
        import hashlib

        import safetensors.torch

        tensors = {k: t.double() for k, t in fold_tensors(sums, LAYOUT).items()}
        digests = {k: hashlib.sha256(t.numpy().tobytes()).hexdigest() for k, t in tensors.items()}
        raw = safetensors.torch.save(tensors, {"format": STORE_FORMAT, TENSOR_SHA256: json.dumps(digests),
                                               **{k: json.dumps(v) for k, v in META.items()}})
        path.write_bytes(raw)
        sha = None
    elif damage == "wrong_shape":
        sha = write_sums(path, sums[:, :5].contiguous(), META)
    elif damage == "foreign":
        import safetensors.torch

        path.write_bytes(safetensors.torch.save({"weight": sums}))
        sha = None
    with pytest.raises(StoreError) as err:
        read_store(path, sha)
    assert str(path) in str(err.value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=4096))
def test_random_bytes_never_traceback(tmp_path, blob):
    path = tmp_path / "random.safetensors"
    path.write_bytes(blob)
    with pytest.raises(StoreError):
        read_store(path)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_real_stores_are_caught_by_their_checksum(tmp_path, data):
    path, _, sha = real_store(tmp_path)
    blob = bytearray(path.read_bytes())
    kind = data.draw(st.sampled_from(["flip", "truncate", "insert"]))
    at = data.draw(st.integers(0, len(blob) - 1))
    if kind == "flip":
        blob[at] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        del blob[at:]
    else:
        blob[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    path.write_bytes(bytes(blob))
    with pytest.raises(StoreError):
        read_store(path, sha)
    # without the checksum a mutated store either parses to a whole store or is a named error
    try:
        store = read_store(path)
        assert store.sums.shape == (3, 8)
    except StoreError:
        pass


def test_json_is_atomic_and_checked(tmp_path):
    write_json(tmp_path / "other.json", {"a": 1})
    assert read_json(tmp_path / "other.json") == {"a": 1}
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(StoreError, match="bad.json"):
        read_json(tmp_path / "bad.json")


HOLD_LOCK = """import sys, time
from twinrun.job import _unit_locks
from twinrun.storage.lock import run_lock
from twinrun.storage.rundir import RunDir
rd = RunDir(sys.argv[1])
with run_lock(rd.lock, _unit_locks(rd, None), shared=False):  # as run_job holds a whole run
    print("held", flush=True)
    time.sleep(60)
"""


def test_second_writer_is_refused_and_a_stale_lock_recovered(tmp_path, capsys):
    # another live process holds the lock
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreError, match=f"being written by pid {holder.pid} on this host"), \
                job_lock(tmp_path):
            pass
    finally:
        holder.kill()
        holder.wait()
    # a lock left by a process that has exited (a real pid, reaped)
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    import socket

    (tmp_path / ".lock").write_text(json.dumps({"pid": child, "host": socket.gethostname()}))
    with job_lock(tmp_path):
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    assert "recovering the stale lock" in capsys.readouterr().out


def test_a_requeued_slurm_job_recovers_its_own_lock_from_another_node(tmp_path, monkeypatch, capsys):
    (tmp_path / ".lock").write_text(json.dumps({"pid": 1, "host": "node-a", "slurm_job_id": "42"}))
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    with job_lock(tmp_path):
        pass
    assert "recovering the stale lock" in capsys.readouterr().out
    monkeypatch.setenv("SLURM_JOB_ID", "43")  # another job's lock is not ours
    (tmp_path / ".lock").write_text(json.dumps({"pid": 1, "host": "node-a", "slurm_job_id": "42"}))
    with pytest.raises(StoreError, match="node-a"), job_lock(tmp_path):
        pass


def test_lock_from_another_host_is_not_stolen(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"pid": 1, "host": "some-other-node"}))
    with pytest.raises(StoreError, match="some-other-node"), job_lock(tmp_path):
        pass


def test_a_flipped_byte_in_a_store_without_its_run_json_is_still_caught(tmp_path):
    path, _, _ = real_store(tmp_path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # inside the float payload
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="does not match its sha256 in the store's metadata"):
        read_store(path)  # no sha256 from run.json: the tensor's own digest catches it


def test_a_read_only_file_system_is_one_named_error(tmp_path, monkeypatch):
    import errno

    def erofs(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "open", erofs)  # atomic_write creates its temporary file with os.open (O_EXCL)
    monkeypatch.setattr(Path, "unlink", erofs)  # the cleanup of the temporary file fails the same way
    with pytest.raises(StoreError, match="x.json: cannot write .Read-only file system"):
        write_json(tmp_path / "x.json", {"a": 1})


@pytest.mark.parametrize("field, value, says", [
    ("sigma", "abc", "field metadata.sigma"),
    ("fold_sizes", [2, 2], "field metadata.fold_sizes"),
    ("layout", [{"name": "w", "offset": 0, "numel": 8}], "field metadata.layout[0].cond"),
    ("bin_index", True, "field metadata.bin_index"),
])
def test_crafted_metadata_with_a_valid_payload_digest_is_refused(tmp_path, field, value, says):
    path = tmp_path / "s.safetensors"
    write_sums(path, torch.ones(3, 8), {**META, field: value})  # its tensors' own digests are valid
    with pytest.raises(StoreError, match=re.escape(says)):
        read_store(path)


def test_a_store_of_nan_never_yields_a_number(tmp_path):
    path = tmp_path / "s.safetensors"
    write_sums(path, torch.full((3, 8), float("nan")), META)  # a forged store: the probe never writes NaN
    with pytest.raises(StoreError, match="NaN or inf"):
        read_store(path)


def test_a_store_larger_than_its_header_says_is_refused_before_reading(tmp_path):
    path, _, _ = real_store(tmp_path)
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)  # written padding
    with pytest.raises(StoreError, match="header describes"):
        read_store(path)


def test_a_sparse_store_is_refused_before_reading(tmp_path):
    path, _, _ = real_store(tmp_path)
    with open(path, "ab") as f:
        f.truncate(path.stat().st_size + (1 << 30))  # 1 GiB of hole: reads as zeros, costs no disk
    with pytest.raises(StoreError, match="a sparse file"):
        read_store(path)


def test_a_summary_written_before_checks_passed_says_reduce_again(tmp_path):
    from twinrun.storage.records import validate_summary

    with pytest.raises(StoreError, match=r"written by an older twinrun .*`python -m twinrun.reduce RUN_DIR`"):
        validate_summary(tmp_path / "summary.json", {"valid": True, "passed": True})
