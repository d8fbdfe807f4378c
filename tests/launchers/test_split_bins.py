"""Runs split by bins (launcher.split=bins): run.json updates from concurrent processes never lose one
another's records, each element holds only its units' locks, and a units-only job measures exactly its units.

The same on a real SLURM job array is in test_slurm.py.
"""

import json
import multiprocessing
import os

import pytest
from conftest import TINY
from rundirs import job_lock, planned_run, refuse
from test_launch_local import store_sums

from twinrun.errors import KernelPathRefused, StoreError
from twinrun.job import run_job
from twinrun.launchers.record import read_launch
from twinrun.launchers.wait import Submitted, _report
from twinrun.plan import plan_run
from twinrun.storage.rundir import RunDir, RunIndex

N_BINS = 8
N_ROUNDS = 12  # each bin marked done this many times (a fresh digest each time) by its own process
SPLIT = {"hashes": {"pin_sigma": "ab", "native": "cd"}, "status": "running",
         "registered": {"estimands": ["all"], "gate_rule": "bit_identical", "signal_alpha": 0.05}}


def _marker(run_dir: str, bins: list[int], start, errors) -> None:
    """One array element: mark its bins done N_ROUNDS times, each time through a fresh load."""
    try:
        start.wait()
        for round_ in range(N_ROUNDS):
            for i in bins:
                index = RunIndex.load(run_dir)
                for arm in ("pin_sigma", "native"):
                    index.mark_done(index.units[i], arm, f"{round_:04x}{i:04x}", "ee", refuse(index))
                index.add_job({"kernel_path_sha256": "ee", "sentinel_start": "s", "sentinel_end": None,
                               "hostname": None, "boot_id": None, "slurm_job_id": str(os.getpid())})
    except BaseException as err:  # noqa: BLE001 — reported to the parent, which fails the test
        errors.put(repr(err))


@pytest.mark.parametrize("n_procs", [2, 4])
def test_concurrent_elements_never_lose_an_update(tmp_path, n_procs):
    planned_run(tmp_path, N_BINS, **SPLIT)
    ctx = multiprocessing.get_context("fork")
    start, errors = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_marker, args=(str(tmp_path), list(range(k, N_BINS, n_procs)), start, errors))
             for k in range(n_procs)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=300)
    assert all(p.exitcode == 0 for p in procs) and errors.empty(), (errors.get() if not errors.empty()
                                                                    else procs)
    run = RunIndex.load(tmp_path).doc
    last = N_ROUNDS - 1
    # every bin carries its own process's last update: none was overwritten by another's stale copy
    assert [(u["stores"]["native"]["status"], u["stores"]["pin_sigma"]["sha256"]) for u in run["units"]] == \
        [("done", f"{last:04x}{i:04x}") for i in range(N_BINS)]
    assert [j["index"] for j in run["jobs"]] == list(range(N_ROUNDS * N_BINS))  # every job record, in order


def test_elements_share_the_run_but_not_a_unit_and_exclude_a_whole_run_job(tmp_path):
    with job_lock(tmp_path, [0, 1]):
        with job_lock(tmp_path, [2]):  # another element, other units: side by side
            pass
        with pytest.raises(StoreError, match=r"\.lock-unit001: is being written by pid"), \
                job_lock(tmp_path, [1, 3]):
            pass
        # a job of the whole run (a resume) while elements measure
        with pytest.raises(StoreError, match="is being written by pid"), job_lock(tmp_path):
            pass
    with job_lock(tmp_path), pytest.raises(StoreError, match="is being written by pid"), \
            job_lock(tmp_path, [0]):
        pass
    assert (tmp_path / ".lock-unit000").read_bytes() == b""  # released: nothing to recover


@pytest.mark.slow
def test_a_bins_job_measures_exactly_its_bins_and_the_last_makes_the_run_measured(tmp_path, compose_cfg,
                                                                                   model_args):
    whole, split = tmp_path / "whole", tmp_path / "split"
    for run_dir in (whole, split):
        plan_run(compose_cfg(["+experiment=pin_sigma", *TINY, *model_args]), run_dir)
    run_job(whole)
    run_job(split, units=[2])
    run = RunIndex.load(split)
    done = [[e["status"] for e in u["stores"].values()] for u in run.units]
    assert run.status == "running" and done[2] == ["done"] * len(done[2])
    assert all(s == "pending" for b in done[:2] for s in b)
    run_job(split, units=[0, 1])
    assert RunIndex.load(split).status == "measured"
    assert store_sums(split) == store_sums(whole)  # the same bits, whichever job measured a bin
    assert len(RunIndex.load(split).doc["jobs"]) == 2
    assert all(j["sentinel_end"] is not None for j in RunIndex.load(split).doc["jobs"])


@pytest.mark.slow
def test_a_failure_at_another_elements_bin_is_kept(tmp_path, compose_cfg, model_args):
    plan_run(compose_cfg(["+experiment=pin_sigma", *TINY, *model_args]), tmp_path)
    index = RunIndex.load(tmp_path)
    index.mark_failed(index.units[1], "pin_sigma", {"type": "ValueError"})
    run_job(tmp_path, units=[0])  # another element starts after bin 1 failed
    run = RunIndex.load(tmp_path)
    assert run.status == "failed" and run.doc["failure"]["unit_index"] == 1
    run_job(tmp_path, units=[1, 2])  # the failed bin measured again: its failure is cleared
    run = RunIndex.load(tmp_path)
    assert run.status == "measured" and "failure" not in run.doc




class _Job:
    job_id = "7_2"

    class paths:
        stderr = "/logs/7_2_log.err"


def test_a_failed_element_is_reported_with_its_bin_and_never_with_anothers(tmp_path, capsys):
    index = planned_run(tmp_path, **SPLIT)
    index.mark_failed(index.units[2], "pin_sigma")  # the element of bin 2 failed there
    assert _report(Submitted(tmp_path, [2], _Job), "FAILED 1:0", ["NonFiniteGradient"]) == 1
    assert _report(Submitted(tmp_path, [0], _Job), "CANCELLED", []) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"twinrun: error: {tmp_path} unit 2: job 7_2 FAILED 1:0: arm pin_sigma failed "
                             "at bin 2 (σ=0.3)") and err[1] == "  | NonFiniteGradient"
    # the element of bin 0 did not fail at bin 2: it says its own job failed, not another's arm
    assert err[3].startswith(f"twinrun: error: {tmp_path} unit 0: job 7_2 CANCELLED: the job failed;")


def test_a_forged_element_in_launch_json_is_refused_naming_the_field(tmp_path):
    job = {"job_id": "7_0", "result": "r", "stdout": "o", "stderr": "e"}
    launch_json = {"cluster": "slurm", **job, "folder": "f", "launcher": {},
                   "elements": [{"units": [0], **job}, {"units": [1], **job, "job_id": "7_1,--help"}]}
    (tmp_path / "launch.json").write_text(json.dumps(launch_json))
    with pytest.raises(StoreError, match=r"field elements\[1\]\.job_id: '7_1,--help' is not a job id"):
        read_launch(RunDir(tmp_path))


def test_two_failed_elements_each_report_their_own_bin_and_cause(tmp_path, capsys):
    planned_run(tmp_path, **SPLIT)
    index = RunIndex.load(tmp_path)
    index.mark_failed(index.units[0], "pin_sigma", {"type": "ValueError", "message": "boom"})
    index.mark_failed(index.units[2], "native")  # later, another element: the run's `failure` is this one
    run = RunIndex.load(tmp_path)  # (the validator reads the stores' failures)
    assert run.doc["failure"]["unit_index"] == 2
    assert run.units[0]["stores"]["pin_sigma"]["failure"]["type"] == "ValueError"
    assert _report(Submitted(tmp_path, [0], _Job), "FAILED 1:0", []) == 4  # the model raised
    assert _report(Submitted(tmp_path, [2], _Job), "FAILED 1:0", []) == 1
    err = capsys.readouterr().err.splitlines()
    assert "unit 0: job 7_2 FAILED 1:0: arm pin_sigma failed at bin 0 (σ=0.1)" in err[0], err
    assert "unit 2: job 7_2 FAILED 1:0: arm native failed at bin 2 (σ=0.3)" in err[2], err
    # bin 0's element restarts: its own failure goes, bin 2's stays
    run.set_status("running", [0])
    run = RunIndex.load(tmp_path)
    assert "failure" not in run.units[0]["stores"]["pin_sigma"]
    assert run.units[2]["stores"]["native"]["failure"]
    assert run.doc["failure"]["unit_index"] == 2


def test_a_bin_finished_meanwhile_on_another_kernel_path_is_refused_at_mark_done(tmp_path, capsys):
    path_a, path_b, sha = "a" * 64, "b" * 64, "c" * 64
    planned_run(tmp_path, **SPLIT)
    mine, other = RunIndex.load(tmp_path), RunIndex.load(tmp_path)  # two elements, loaded at their start
    rule_a, rule_b = refuse(other), refuse(mine)  # each element's straddling rule, as run_job hands it
    # a bin cut short commits the run to nothing:
    other.mark_done(other.units[0], "native", sha, path_a, rule_a)
    mine.mark_done(mine.units[1], "native", sha, path_b, rule_b)
    other.mark_done(other.units[0], "pin_sigma", sha, path_a, rule_a)  # bin 0 whole on path A, concurrently
    with pytest.raises(KernelPathRefused, match="its finished units were measured on another kernel path"):
        mine.mark_done(mine.units[1], "pin_sigma", sha, path_b, rule_b)
    assert RunIndex.load(tmp_path).units[1]["stores"]["pin_sigma"]["status"] == "pending"
    # recorded at the element's bin (as the job's failure_recorded does), the launcher says exit 3
    mine.mark_failed(mine.units[1], "pin_sigma", {"refused": "kernel_path"})
    assert _report(Submitted(tmp_path, [1], _Job), "FAILED 1:0", []) == 3


def test_a_whole_run_job_meets_an_element_on_another_host_at_its_bin_lock(tmp_path):
    # elements hold .lock shared and record no holder there; across hosts (flocks per host) the
    # whole-run job sees the element only through the holder record in its bin lock
    planned_run(tmp_path, **SPLIT)
    (tmp_path / ".lock-unit002").write_text(json.dumps({"pid": 1, "host": "some-other-node"}))
    with pytest.raises(StoreError, match=r"some-other-node.*\.lock-unit002"), job_lock(tmp_path):
        pass
    (tmp_path / ".lock-unit002").write_text("")
    with job_lock(tmp_path):  # the whole run holds every unit: an element here is refused
        assert json.loads((tmp_path / ".lock-unit001").read_text())["pid"] == os.getpid()
    assert (tmp_path / ".lock-unit001").read_bytes() == b"" and (tmp_path / ".lock").read_bytes() == b""


def test_one_elements_interrupt_leaves_the_run_to_the_others(tmp_path):
    planned_run(tmp_path, **SPLIT)
    RunIndex.load(tmp_path).mark_interrupted([1])  # one element's SIGTERM: the others still measure
    assert RunIndex.load(tmp_path).status == "running"
    RunIndex.load(tmp_path).mark_interrupted()  # a whole-run job's
    assert RunIndex.load(tmp_path).status == "interrupted"
