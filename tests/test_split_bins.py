"""Runs split by bins (launcher.split=bins): run.json updates from concurrent processes never lose one
another's records, each element holds only its bins' locks, and a bins-only job measures exactly its bins.

The same on a real SLURM job array is in test_slurm.py.
"""

import json
import multiprocessing
import os

import pytest
from conftest import TINY
from test_launch import store_sums

from twinrun import launch
from twinrun.errors import StoreError
from twinrun.lock import run_lock
from twinrun.run import plan_run, run_job
from twinrun.rundir import RunIndex

N_BINS = 8
N_ROUNDS = 12  # each bin marked done this many times (a fresh digest each time) by its own process


def _run_json(n_bins: int) -> dict:
    store = {"file": "s.safetensors", "status": "pending"}
    return {"format": "twinrun-run/1", "status": "running", "command": None, "reference": None,
            "arms": [{"name": "pin_sigma", "role": "intervention", "config_hash": "ab"},
                     {"name": "native", "role": "twin", "config_hash": "cd"}],
            "registered": {"estimands": ["all"], "gate_rule": "bit_identical", "signal_alpha": 0.05},
            "bins": [{"index": i, "sigma": 0.1 * (i + 1), "gate": False,
                      "stores": {"pin_sigma": dict(store), "native": dict(store)}} for i in range(n_bins)]}


def _marker(run_dir: str, bins: list[int], start, errors) -> None:
    """One array element: mark its bins done N_ROUNDS times, each time through a fresh load."""
    try:
        start.wait()
        for round_ in range(N_ROUNDS):
            for i in bins:
                index = RunIndex.load(run_dir)
                for arm in ("pin_sigma", "native"):
                    index.mark_done(index.bins[i], arm, f"{round_:04x}{i:04x}", "ee")
                index.add_job({"kernel_path_sha256": "ee", "sentinel_start": "s", "sentinel_end": None,
                               "hostname": None, "boot_id": None, "slurm_job_id": str(os.getpid())})
    except BaseException as err:  # noqa: BLE001 — reported to the parent, which fails the test
        errors.put(repr(err))


@pytest.mark.parametrize("n_procs", [2, 4])
def test_concurrent_elements_never_lose_an_update(tmp_path, n_procs):
    (tmp_path / "run.json").write_text(json.dumps(_run_json(N_BINS)))
    ctx = multiprocessing.get_context("fork")
    start, errors = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_marker, args=(str(tmp_path), list(range(k, N_BINS, n_procs)), start, errors))
             for k in range(n_procs)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=300)
    assert all(p.exitcode == 0 for p in procs) and errors.empty(), errors.get() if not errors.empty() else procs
    run = RunIndex.load(tmp_path).doc
    last = N_ROUNDS - 1
    # every bin carries its own process's last update: none was overwritten by another's stale copy
    assert [(b["stores"]["native"]["status"], b["stores"]["pin_sigma"]["sha256"]) for b in run["bins"]] == \
        [("done", f"{last:04x}{i:04x}") for i in range(N_BINS)]
    assert [j["index"] for j in run["jobs"]] == list(range(N_ROUNDS * N_BINS))  # every job record, in order


def test_elements_share_the_run_but_not_a_bin_and_exclude_a_whole_run_job(tmp_path):
    with run_lock(tmp_path, bins=[0, 1]):
        with run_lock(tmp_path, bins=[2]):  # another element, other bins: side by side
            pass
        with pytest.raises(StoreError, match=r"\.lock-bin001: is being written by pid"), run_lock(tmp_path, [1, 3]):
            pass
        # a job of the whole run (a resume) while elements measure
        with pytest.raises(StoreError, match="is being written by pid"), run_lock(tmp_path):
            pass
    with run_lock(tmp_path), pytest.raises(StoreError, match="is being written by pid"), run_lock(tmp_path, [0]):
        pass
    assert (tmp_path / ".lock-bin000").read_bytes() == b""  # released: nothing to recover


@pytest.mark.slow
def test_a_bins_job_measures_exactly_its_bins_and_the_last_makes_the_run_measured(tmp_path, compose_cfg,
                                                                                   model_args):
    whole, split = tmp_path / "whole", tmp_path / "split"
    for run_dir in (whole, split):
        plan_run(compose_cfg(["+experiment=pin_sigma", *TINY, *model_args]), run_dir)
    run_job(whole)
    run_job(split, bins=[2])
    run = RunIndex.load(split)
    done = [[e["status"] for e in b["stores"].values()] for b in run.bins]
    assert run.status == "running" and done[2] == ["done"] * len(done[2])
    assert all(s == "pending" for b in done[:2] for s in b)
    run_job(split, bins=[0, 1])
    assert RunIndex.load(split).status == "measured"
    assert store_sums(split) == store_sums(whole)  # the same bits, whichever job measured a bin
    assert len(RunIndex.load(split).doc["jobs"]) == 2
    assert all(j["sentinel_end"] is not None for j in RunIndex.load(split).doc["jobs"])


@pytest.mark.slow
def test_a_failure_at_another_elements_bin_is_kept(tmp_path, compose_cfg, model_args):
    plan_run(compose_cfg(["+experiment=pin_sigma", *TINY, *model_args]), tmp_path)
    index = RunIndex.load(tmp_path)
    index.mark_failed(index.bins[1], "pin_sigma", {"type": "ValueError"})
    run_job(tmp_path, bins=[0])  # another element starts after bin 1 failed
    run = RunIndex.load(tmp_path)
    assert run.status == "failed" and run.doc["failure"]["bin_index"] == 1
    run_job(tmp_path, bins=[1, 2])  # the failed bin measured again: its failure is cleared
    run = RunIndex.load(tmp_path)
    assert run.status == "measured" and "failure" not in run.doc




class _Job:
    job_id = "7_2"

    class paths:
        stderr = "/logs/7_2_log.err"


def test_a_failed_element_is_reported_with_its_bin_and_never_with_anothers(tmp_path, capsys):
    doc = _run_json(3)
    doc.update(status="failed", failure={"arm": "pin_sigma", "bin_index": 2, "sigma": 0.3})
    (tmp_path / "run.json").write_text(json.dumps(doc))
    assert launch._report(launch.Element(tmp_path, [2], _Job), "FAILED 1:0", ["NonFiniteGradient"]) == 1
    assert launch._report(launch.Element(tmp_path, [0], _Job), "CANCELLED", []) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"twinrun: error: {tmp_path} bin 2: job 7_2 FAILED 1:0: arm pin_sigma failed at "
                             "bin 2 (σ=0.3)") and err[1] == "  | NonFiniteGradient"
    # the element of bin 0 did not fail at bin 2: it says its own job failed, not another's arm
    assert err[3].startswith(f"twinrun: error: {tmp_path} bin 0: job 7_2 CANCELLED: the job failed;")


def test_a_forged_element_in_launch_json_is_refused_naming_the_field(tmp_path):
    from twinrun.store import read_json

    job = {"job_id": "7_0", "result": "r", "stdout": "o", "stderr": "e"}
    launch_json = {"cluster": "slurm", **job, "folder": "f", "launcher": {},
                   "elements": [{"bins": [0], **job}, {"bins": [1], **job, "job_id": "7_1,--help"}]}
    (tmp_path / "launch.json").write_text(json.dumps(launch_json))
    with pytest.raises(StoreError, match=r"field elements\[1\]\.job_id: '7_1,--help' is not a job id"):
        read_json(tmp_path / "launch.json")


def test_two_failed_elements_each_report_their_own_bin_and_cause(tmp_path, capsys):
    (tmp_path / "run.json").write_text(json.dumps(_run_json(3)))
    index = RunIndex.load(tmp_path)
    index.mark_failed(index.bins[0], "pin_sigma", {"type": "ValueError", "message": "boom"})
    index.mark_failed(index.bins[2], "native")  # later, another element: the run's `failure` is this one
    run = RunIndex.load(tmp_path)  # (the validator reads the stores' failures)
    assert run.doc["failure"]["bin_index"] == 2 and run.bins[0]["stores"]["pin_sigma"]["failure"]["type"] == "ValueError"
    assert launch._report(launch.Element(tmp_path, [0], _Job), "FAILED 1:0", []) == 4  # the model raised
    assert launch._report(launch.Element(tmp_path, [2], _Job), "FAILED 1:0", []) == 1
    err = capsys.readouterr().err.splitlines()
    assert "bin 0: job 7_2 FAILED 1:0: arm pin_sigma failed at bin 0" in err[0], err
    assert "bin 2: job 7_2 FAILED 1:0: arm native failed at bin 2" in err[2], err
    # bin 0's element restarts: its own failure goes, bin 2's stays
    run.set_status("running", [0])
    run = RunIndex.load(tmp_path)
    assert "failure" not in run.bins[0]["stores"]["pin_sigma"] and run.bins[2]["stores"]["native"]["failure"]
    assert run.doc["failure"]["bin_index"] == 2


def test_a_bin_finished_meanwhile_on_another_kernel_path_is_refused_at_mark_done(tmp_path, capsys):
    from twinrun.provenance import KernelPathRefused

    path_a, path_b, sha = "a" * 64, "b" * 64, "c" * 64
    (tmp_path / "run.json").write_text(json.dumps(_run_json(3)))
    mine, other = RunIndex.load(tmp_path), RunIndex.load(tmp_path)  # two elements, loaded at their start
    other.mark_done(other.bins[0], "native", sha, path_a)  # a bin cut short commits the run to nothing:
    mine.mark_done(mine.bins[1], "native", sha, path_b)
    other.mark_done(other.bins[0], "pin_sigma", sha, path_a)  # bin 0 whole on path A, concurrently
    with pytest.raises(KernelPathRefused, match="bin 1: another job finished bins of this run on another"):
        mine.mark_done(mine.bins[1], "pin_sigma", sha, path_b)
    assert RunIndex.load(tmp_path).bins[1]["stores"]["pin_sigma"]["status"] == "pending"
    # recorded at the element's bin (as measure's failure_recorded does), the launcher says exit 3
    mine.mark_failed(mine.bins[1], "pin_sigma", {"refused": "kernel_path"})
    assert launch._report(launch.Element(tmp_path, [1], _Job), "FAILED 1:0", []) == 3


def test_a_whole_run_job_meets_an_element_on_another_host_at_its_bin_lock(tmp_path):
    # elements hold .lock shared and record no holder there; across hosts (flocks per host) the
    # whole-run job sees the element only through the holder record in its bin lock
    (tmp_path / "run.json").write_text(json.dumps(_run_json(3)))
    (tmp_path / ".lock-bin002").write_text(json.dumps({"pid": 1, "host": "some-other-node"}))
    with pytest.raises(StoreError, match=r"some-other-node.*\.lock-bin002"), run_lock(tmp_path):
        pass
    (tmp_path / ".lock-bin002").write_text("")
    with run_lock(tmp_path):  # the whole run holds every bin: an element here is refused
        assert json.loads((tmp_path / ".lock-bin001").read_text())["pid"] == os.getpid()
    assert (tmp_path / ".lock-bin001").read_bytes() == b"" and (tmp_path / ".lock").read_bytes() == b""


def test_one_elements_interrupt_leaves_the_run_to_the_others(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps(_run_json(3)))
    RunIndex.load(tmp_path).mark_interrupted([1])  # one element's SIGTERM: the others still measure
    assert RunIndex.load(tmp_path).status == "running"
    RunIndex.load(tmp_path).mark_interrupted()  # a whole-run job's
    assert RunIndex.load(tmp_path).status == "interrupted"
