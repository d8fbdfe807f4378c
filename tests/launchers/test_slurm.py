"""twinrun on a real SLURM (the local single-node cluster of launch/slurm-up.sh), through the real CLI.

A pair job, a sweep as one job array, a preemption that resumes, a failing arm, a cancelled job and bad
input. Tests wait on run-directory files, squeue and sacct, never on submitit's cached job state.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import submitit
import torch
from conftest import TINY, run_twinrun
from safetensors.torch import load_file
from test_launch_local import launcher, store_sums, write_failing_module

from twinrun.errors import ConfigError, StoreError
from twinrun.files import read_json
from twinrun.launchers import check
from twinrun.launchers.placement import Element
from twinrun.launchers.record import read_launch
from twinrun.launchers.slurm import SLURM_ENDED, sacct_state
from twinrun.launchers.submit import submit
from twinrun.launchers.wait import wait
from twinrun.storage.rundir import RunDir, RunIndex
from twinrun.storage.sample_store import read_sample_store
from twinrun.storage.store import read_store

pytestmark = pytest.mark.slurm

# Long enough to interrupt: the default 8-bin grid, 16 images x 8 draws (0.3-4 s a bin on 2 busy cores).
LONGER = ["probe.n_images=16", "probe.n_draws=8", "probe.n_folds=4"]


@pytest.fixture(scope="module")
def slurm_args(slurm_cluster) -> list[str]:
    return ["launcher=slurm", f"launcher.partition={slurm_cluster['partition']}", "launcher.gpus_per_node=0",
            "launcher.cpus_per_task=1", "launcher.timeout_min=5", "launcher.poll_s=0.5"]


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory, model_args) -> Path:
    """The TINY pair measured in-process: every SLURM job of the same config must reproduce it."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, *model_args, f"hydra.run.dir={tmp / 'run'}"], cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tmp / "run"


def final_state(job_id: str, timeout_s: float = 30) -> str:
    """sacct's state once the job has ended (sacct lags squeue by a moment)."""
    deadline = time.time() + timeout_s
    while True:
        state = sacct_state(job_id) or "UNKNOWN"
        if state.split()[0] in SLURM_ENDED or time.time() > deadline:
            return state
        time.sleep(0.5)


def launch_json(run_dir: Path) -> dict:
    """launch.json, validated as every reader reads it."""
    return read_launch(RunDir(run_dir))


def run_json(run_dir: Path) -> dict:
    """run.json, validated as every reader reads it."""
    return RunIndex.load(run_dir).doc


def bin_records(run_dir: Path) -> list[dict]:
    """Per bin, {arm: the allocation its store records}."""
    index = RunIndex.load(run_dir)
    return [{arm: read_store(index.store_path(u, arm), e["sha256"]).meta["env"]
             for arm, e in u["stores"].items()} for u in index.units]


def assert_bins_paired_in_one_process(run_dir: Path, job_id: str) -> None:
    for records in bin_records(run_dir):
        assert {r["slurm_job_id"] for r in records.values()} == {job_id}, records
        where = {(r["hostname"], r["boot_id"], r["pid"], r["slurm_restart_count"]) for r in records.values()}
        assert len(where) == 1, records


def test_pair_job_measures_both_arms_in_one_allocation(tmp_path, slurm_args, model_args, local_reference):
    run_dir = tmp_path / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, *model_args, *slurm_args, f"hydra.run.dir={run_dir}"],
                       cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launched = launch_json(run_dir)
    job_id = launched["job_id"]
    assert launched["cluster"] == "slurm" and launched["array_job_id"] is None
    assert f"submitted SLURM job {job_id} for {run_dir}" in proc.stdout
    assert "units done: pin_sigma 3/3, native 3/3" in proc.stdout and "effects (debiased cos" in proc.stdout
    assert final_state(job_id) == "COMPLETED 0:0"
    # one job (SLURM id, node, boot, process) wrote both arms of every bin
    assert_bins_paired_in_one_process(run_dir, job_id)
    # same kernel path as the in-process run, so the same bits
    ref_store = read_store(next((local_reference / "arms" / "native").glob("*.safetensors")))
    job_store = read_store(run_dir / "arms" / "native" / ref_store.path.name)
    assert job_store.meta["kernel_path"] == ref_store.meta["kernel_path"]
    assert store_sums(run_dir) == store_sums(local_reference)
    # resuming a SLURM run submits it again (never measures in the calling shell)
    run = run_json(run_dir)
    run["units"][0]["stores"]["native"]["status"] = "pending"
    (run_dir / "run.json").write_text(json.dumps(run))
    resumed = run_twinrun([str(run_dir)], cwd=tmp_path, module="twinrun.resume", timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = launch_json(run_dir)
    assert "submitting it again" in resumed.stdout and again["job_id"] != job_id
    assert again["earlier"][0]["job_id"] == job_id and store_sums(run_dir) == store_sums(local_reference)


def test_twin_sampling_runs_as_one_slurm_job_with_the_in_process_bits(tmp_path, slurm_args):
    # A third kind through the same launcher: every arm's chunks in one allocation, one process, and the
    # stores bit for bit those of the same run measured in the calling shell (one kernel path).
    small = ["+experiment=sample_pin_sigma", "sample.n_samples=4", "sample.chunk_samples=2", "sample.steps=3",
             "sample.device=cpu"]
    here = run_twinrun([*small, f"hydra.run.dir={tmp_path / 'here'}"], cwd=tmp_path)
    assert here.returncode == 0, here.stderr[-2000:]
    run_dir = tmp_path / "run"
    proc = run_twinrun([*small, *slurm_args, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = launch_json(run_dir)["job_id"]
    assert final_state(job_id) == "COMPLETED 0:0"
    index = RunIndex.load(run_dir)
    for u in index.units:  # every arm's chunk in one allocation and one process
        envs = [read_sample_store(index.store_path(u, arm), e["sha256"])[1]["env"]
                for arm, e in u["stores"].items()]
        assert {r["slurm_job_id"] for r in envs} == {job_id}, envs
        assert len({(r["hostname"], r["boot_id"], r["pid"], r["slurm_restart_count"]) for r in envs}) == 1
    assert {arm for u in index.units for arm in u["stores"]} == {"pin_sigma", "native", "native_replicate",
                                                                 "pin_sigma_noop"}
    for arm in ("native", "pin_sigma", "pin_sigma_noop"):
        for path in sorted((tmp_path / "here" / "arms" / arm).glob("*.safetensors")):
            mine, theirs = load_file(path), load_file(run_dir / "arms" / arm / path.name)
            assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), path


def test_sweep_is_one_job_array_with_both_arms_in_each_element(tmp_path, slurm_args, model_args,
                                                                local_reference):
    sweep = tmp_path / "sweep"
    proc = run_twinrun(["-m", "+experiment=pin_sigma", "intervention.sigma_pin=0.5,1.2", *TINY, *model_args,
                        *slurm_args, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launched = [launch_json(sweep / point) for point in ("0", "1")]
    array = launched[0]["array_job_id"]
    assert [(x["job_id"], x["array_job_id"], x["array_task_id"]) for x in launched] == \
        [(f"{array}_0", array, 0), (f"{array}_1", array, 1)]
    assert f"submitted SLURM job array {array} (2 runs" in proc.stdout
    assert [final_state(x["job_id"]) for x in launched] == ["COMPLETED 0:0"] * 2
    for point in (0, 1):
        records = [r for b in bin_records(sweep / str(point)) for r in b.values()]
        assert {(r["slurm_array_job_id"], r["slurm_array_task_id"]) for r in records} == {(array, str(point))}
        # SLURM_JOB_ID of an array element is its own number; both arms of each bin share it
        assert_bins_paired_in_one_process(sweep / str(point), records[0]["slurm_job_id"])
    assert store_sums(sweep / "0") == store_sums(local_reference)  # point 0 is the reference's config
    assert (sweep / "sweep_summary.json").is_file()


def whole_bins(run_dir: Path) -> list[dict]:
    try:
        return RunIndex.load(run_dir).whole_units()
    except StoreError:  # not planned yet
        return []


def test_preempted_job_requeues_and_resumes_without_recomputing(tmp_path, slurm_args, model_args):
    # bins long enough (~0.2 s per arm on a quiet 2-core machine) that USR2 lands mid-run
    common = ["+experiment=pin_sigma", "probe.n_images=40", "probe.n_draws=48", "probe.n_folds=8",
              *model_args]
    ref_dir, job_dir = tmp_path / "reference", tmp_path / "job"
    popen = {"cwd": tmp_path, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    twinrun = [sys.executable, "-m", "twinrun", *common]
    job = subprocess.Popen([*twinrun, *slurm_args, f"hydra.run.dir={job_dir}"], **popen)
    deadline = time.time() + 240  # queueing, start-up and two bins on a loaded 2-core machine
    while len(whole_bins(job_dir)) < 2:
        assert time.time() < deadline and job.poll() is None, "the job did not finish two bins in time"
        time.sleep(0.05)
    launched = launch_json(job_dir)
    subprocess.run(["scancel", "--signal=USR2", launched["job_id"]], check=True)  # what a preemption sends
    finished_before = {job_dir / "arms" / arm / e["file"]
                       for b in whole_bins(job_dir) for arm, e in b["stores"].items()}
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in finished_before}
    assert len(whole_bins(job_dir)) < 8, "the job finished before it was signalled: make LONGER longer"
    # the uninterrupted run of the same config, in-process, measured while the job waits to restart
    reference = subprocess.Popen([*twinrun, f"hydra.run.dir={ref_dir}"], **popen)

    _, err = job.communicate(timeout=150)
    assert job.returncode == 0, err[-3000:]
    assert reference.wait(timeout=60) == 0
    assert final_state(launched["job_id"]) == "COMPLETED 0:0"
    # no finished bin was recomputed: same files, untouched
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in finished_before} == before
    log = Path(launched["stdout"]).read_text()
    assert "requeueing, the next start resumes from them" in log and "Requeued job" in log
    resumed = [line for line in log.splitlines() if "start 2 on" in line]
    assert len(resumed) == 1 and "skipped on resume: 0, 1" in resumed[0], log
    # both starts belong to the one SLURM job; each bin's pair is whole within one of them
    assert_bins_paired_in_one_process(job_dir, launched["job_id"])
    restarts = [b["native"]["slurm_restart_count"] for b in bin_records(job_dir)]
    assert restarts[0] in (None, "0") and restarts[-1] == "1"
    # and the result is bit-identical to the uninterrupted run
    assert store_sums(job_dir) == store_sums(ref_dir)


def test_failing_arm_ends_the_job_failed_and_names_arm_and_bin(tmp_path, slurm_args, model_args):
    modules = write_failing_module(tmp_path / "user_code")  # reaches the job through sbatch's exported env
    run_dir = tmp_path / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, *model_args, *slurm_args,
                        "intervention._target_=tw_failing.NaNAbove", f"hydra.run.dir={run_dir}"],
                       cwd=tmp_path, timeout=120, env={"PYTHONPATH": str(modules)})
    assert proc.returncode == 1, proc.stderr[-3000:]
    job_id = launch_json(run_dir)["job_id"]
    assert f"job {job_id} FAILED 1:0: arm pin_sigma failed at bin 2 (σ=1.2)" in proc.stderr
    assert "NonFiniteGradient: arm pin_sigma, bin 2 (σ=1.2)" in proc.stderr  # the error's tail
    assert final_state(job_id) == "FAILED 1:0"
    run = run_json(run_dir)
    assert run["status"] == "failed" and run["failure"] == {"arm": "pin_sigma", "unit_index": 2,
                                                            "unit": "bin 2 (σ=1.2)"}
    # bins 0 and 1 of both arms (+ the gate replicate) stay valid
    # and bin 2's twin, measured first (the pairing receipt), before the intervention failed
    assert len(store_sums(run_dir)) == 2 * 2 + 1 + 1


def test_no_wait_then_status_then_a_cancelled_job_ends_the_wait(tmp_path, slurm_args, model_args, capsys):
    run_dir = tmp_path / "run"
    # held PENDING (sbatch --begin) so that it cannot finish before it is cancelled, however fast
    proc = run_twinrun(["+experiment=pin_sigma", *LONGER, *model_args, *slurm_args, "launcher.wait=false",
                        "+launcher.additional_parameters.begin=now+300", f"hydra.run.dir={run_dir}"],
                       cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launched = launch_json(run_dir)
    assert f"python -m twinrun.status {run_dir}" in proc.stdout
    shown = run_twinrun([str(run_dir)], cwd=tmp_path, module="twinrun.status")
    assert shown.returncode == 0 and f"job {launched['job_id']} " in shown.stdout
    assert re.search(rf"job {launched['job_id']} (PENDING|RUNNING)\b", shown.stdout), shown.stdout
    subprocess.run(["scancel", launched["job_id"]], check=True)
    # a job gone without a result pickle: waiting must end, not hang
    job = submitit.SlurmJob(folder=launched["folder"], job_id=launched["job_id"])
    t0 = time.time()
    assert wait([(Element(run_dir, None), job)], launched["launcher"]) == {run_dir: 2}
    assert time.time() - t0 < 30
    err = capsys.readouterr().err
    assert f"job {launched['job_id']} CANCELLED" in err and "without a result" in err


def test_bad_settings_are_refused_against_the_real_cluster(slurm_cluster, tmp_path):
    base = launcher(name="slurm", partition=slurm_cluster["partition"], gpus_per_node=0, timeout_min=5,
                    cpus_per_task=1)
    check(base)
    for knobs, key, says in (({"partition": "nope"}, "launcher.partition", "choose one of debug"),
                             ({"cpus_per_task": 64}, "launcher.cpus_per_task", "largest node has"),
                             ({"mem_gb": 4096}, "launcher.mem_gb", "largest node has"),
                             ({"gpus_per_node": 1}, "launcher.gpus_per_node", "has no GPUs"),
                             ({"timeout_min": 2}, "launcher.timeout_min", "timeout_min ≥ 3")):
        with pytest.raises(ConfigError) as err:
            check({**base, **knobs})
        assert err.value.key == key and says in str(err.value)
    # what only sbatch can tell, at submission
    with pytest.raises(ConfigError) as err:
        submit([tmp_path], {**base, "additional_parameters": {"nodelist": "nosuchnode"}}, tmp_path)
    assert err.value.key == "launcher.additional_parameters" and "Invalid node name" in str(err.value)


def test_the_documented_command_runs_on_a_cpu_only_cluster_with_the_partitions_defaults(tmp_path, model_args,
                                                                                       slurm_cluster):
    """`launcher=slurm` and nothing else: no GPU requested where the partition has none, CPUs within its
    node (read from sinfo), and the run measured and reduced."""
    run_dir = tmp_path / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, *model_args, "launcher=slurm",
                        "launcher.timeout_min=5", "launcher.poll_s=0.5", f"hydra.run.dir={run_dir}"],
                       cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    asked = launch_json(run_dir)["launcher"]
    sinfo = subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True, check=True)
    cpus = int(sinfo.stdout.split()[0])
    assert asked["gpus_per_node"] == 0 and 1 <= asked["cpus_per_task"] <= cpus
    assert final_state(launch_json(run_dir)["job_id"]) == "COMPLETED 0:0"


def test_every_problem_of_a_submission_is_one_line_against_the_real_cluster(slurm_cluster):
    with pytest.raises(ConfigError) as err:
        check(launcher(name="slurm", partition="nope", gpus_per_node=1, cpus_per_task=512, timeout_min=5))
    said = str(err.value)
    assert all(k in said for k in ("launcher.partition='nope'", "launcher.gpus_per_node=1",
                                   "launcher.cpus_per_task=512")), said


@pytest.mark.parametrize("override, error", [
    ("launcher.partition=nope", "launcher.partition='nope': no such partition on this cluster"),
    ("launcher.gpus_per_node=1", "launcher.gpus_per_node=1: partition debug has no GPUs"),
])
def test_bad_slurm_input_is_one_line_exit_2_from_the_cli(tmp_path, slurm_args, model_args, override, error):
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, *model_args, *slurm_args, override,
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"twinrun: error: {error}")


# ----------------------------------------------------------------------------- launcher.split=bins


def assert_each_bin_in_its_own_element(run_dir: Path) -> set[str]:
    """Every bin's stores (both arms, the gate replicate) come from one process of one array element,
    and no two bins from the same element; returns the elements' SLURM job ids."""
    ids = []
    for records in bin_records(run_dir):
        where = {(r["slurm_job_id"], r["hostname"], r["boot_id"], r["pid"]) for r in records.values()}
        assert len(where) == 1, records
        ids.append(next(iter(where))[0])
    assert len(set(ids)) == len(ids), ids
    return set(ids)


def test_split_bins_measures_each_bin_as_an_array_element_with_the_pairs_bits(tmp_path, slurm_args,
                                                                              model_args, local_reference):
    run_dir = tmp_path / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, *model_args, *slurm_args, "launcher.split=bins",
                        f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launched = launch_json(run_dir)
    array = launched["array_job_id"]
    assert [(e["units"], e["job_id"]) for e in launched["elements"]] == \
        [([k], f"{array}_{k}") for k in range(3)]
    assert f"submitted SLURM job array {array} (3 jobs" in proc.stdout
    assert [final_state(e["job_id"]) for e in launched["elements"]] == ["COMPLETED 0:0"] * 3
    assert len(assert_each_bin_in_its_own_element(run_dir)) == 3
    run = run_json(run_dir)
    assert run["status"] == "measured" and len(run["jobs"]) == 3
    # one kernel path on this one machine: the same bits as the pair measured in one process
    assert store_sums(run_dir) == store_sums(local_reference)
    assert RunDir(run_dir).read_summary()["checks_passed"] is True


def test_split_bins_sweep_is_one_array_of_points_times_bins(tmp_path, slurm_args, model_args,
                                                            local_reference):
    sweep = tmp_path / "sweep"
    proc = run_twinrun(["-m", "+experiment=pin_sigma", "intervention.sigma_pin=0.5,1.2", *TINY, *model_args,
                        *slurm_args, "launcher.split=bins", f"hydra.sweep.dir={sweep}"], cwd=tmp_path,
                       timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launched = [launch_json(sweep / point) for point in ("0", "1")]
    array = launched[0]["array_job_id"]
    assert [e["job_id"] for x in launched for e in x["elements"]] == [f"{array}_{k}" for k in range(6)]
    for point in ("0", "1"):
        assert len(assert_each_bin_in_its_own_element(sweep / point)) == 3
    assert store_sums(sweep / "0") == store_sums(local_reference)
    assert read_json(sweep / "sweep_summary.json")["all_valid"] is True


def test_split_bins_a_cancelled_element_is_measured_on_resume(tmp_path, slurm_args, model_args,
                                                              local_reference):
    run_dir = tmp_path / "run"
    # held PENDING (sbatch --begin) so that one element can be cancelled before it runs, however fast
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, *model_args, *slurm_args, "launcher.split=bins",
                        "launcher.wait=false", "+launcher.additional_parameters.begin=now+300",
                        f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    elements = launch_json(run_dir)["elements"]
    subprocess.run(["scancel", elements[1]["job_id"]], check=True)
    for e in (elements[0], elements[2]):
        subprocess.run(["scontrol", "update", f"jobid={e['job_id']}", "StartTime=now"], check=True)
    assert ([final_state(e["job_id"], timeout_s=240) for e in (elements[0], elements[2])]
            == ["COMPLETED 0:0"] * 2)
    run = run_json(run_dir)
    assert [all(s["status"] == "done" for s in u["stores"].values()) for u in run["units"]] == \
        [True, False, True]
    assert run["status"] != "measured"
    shown = run_twinrun([str(run_dir)], cwd=tmp_path, module="twinrun.status")
    array = elements[0]["job_id"].split("_")[0]  # one array: named once, not each element's id
    assert f"job array {array} ({len(elements)} elements) " in shown.stdout
    # a pending element cancelled before it ran may be unknown to sacct: squeue's word, or GONE
    assert re.search(r"unit 1 (CANCELLED|GONE)", shown.stdout), shown.stdout
    # resume submits the missing bin only, as one element, and the run reduces to the pair's bits
    # (with the launcher launch.json recorded: drop this test's hold and no-wait from it first)
    launched = launch_json(run_dir)
    launched["launcher"].update(wait=True, additional_parameters={})
    (run_dir / "launch.json").write_text(json.dumps(launched))
    resumed = run_twinrun([str(run_dir)], cwd=tmp_path, module="twinrun.resume", timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = launch_json(run_dir)
    assert [e["units"] for e in again["elements"]] == [[1]]
    assert again["earlier"][0]["elements"] == elements
    assert store_sums(run_dir) == store_sums(local_reference)
    assert len(assert_each_bin_in_its_own_element(run_dir)) == 3
