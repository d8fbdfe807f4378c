"""launcher.pack=N: N twin runs in one job on one node, one process per run and per GPU; a preemption
requeues the pack whole and each run resumes from its finished units; status and launch.json say so.

The GPU assignment is checked with faked device lists; the packing itself on the local SLURM, with CPU
processes."""

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import TINY, run_twinrun
from rundirs import planned_run
from test_launch_local import launcher, store_sums
from test_slurm import final_state, launch_json, local_reference, run_json, slurm_args  # noqa: F401

from twinrun.errors import ConfigError
from twinrun.launchers import check
from twinrun.launchers.jobs import PackedJob, assign_devices
from twinrun.launchers.placement import Element, jobs_of, place
from twinrun.launchers.record import describe, progress, read_launch, write_launch
from twinrun.storage.rundir import RunDir, RunIndex


def test_each_run_of_a_pack_gets_its_own_gpu_from_the_jobs_list():
    assert assign_devices(3, "0,1,2,3") == ["0", "1", "2"]
    assert assign_devices(4, "GPU-aa,GPU-bb,GPU-cc,GPU-dd") == ["GPU-aa", "GPU-bb", "GPU-cc", "GPU-dd"]
    assert assign_devices(4, "4,6") == ["4", "6", "4", "6"]  # fewer GPUs than runs: they take turns
    assert assign_devices(2, None) == ["", ""] and assign_devices(2, "") == ["", ""]  # a CPU job: no GPU
    assert assign_devices(2, "-1") == ["", ""]


def test_a_pack_with_fewer_gpus_than_runs_runs_one_process_per_gpu_at_a_time(tmp_path, monkeypatch):
    """PackedJob's scheduling, with `python -m twinrun.launchers.jobs` replaced by a process that records
    its CUDA_VISIBLE_DEVICES and when it ran."""
    log = tmp_path / "log"
    job = PackedJob([tmp_path / f"r{k}" for k in range(4)])

    def start(run_dir, device):
        code = ("import sys, time\n"
                "def say(w):\n"
                "    open(sys.argv[1], 'a').write(f'{sys.argv[2]} {sys.argv[3]} {time.monotonic()} {w}\\n')\n"
                "say('start'); time.sleep(0.6); say('end')")
        return subprocess.Popen([sys.executable, "-c", code, str(log), Path(run_dir).name, device])

    monkeypatch.setattr(job, "_start", start)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    codes = job()
    assert sorted(codes.values()) == [0, 0, 0, 0]
    events = [line.split() for line in log.read_text().splitlines()]
    assert {(run, gpu) for run, gpu, _, what in events if what == "start"} == \
        {("r0", "3"), ("r1", "5"), ("r2", "3"), ("r3", "5")}
    for gpu in ("3", "5"):  # never two processes on one GPU at once
        spans = sorted((float(t), what) for _, g, t, what in events if g == gpu)
        assert [what for _, what in spans] == ["start", "end", "start", "end"], spans


def test_a_pack_job_pickles_without_its_processes(tmp_path):
    import pickle

    job = PackedJob([tmp_path / "a", tmp_path / "b"], ["mymodule"])
    job._children["x"] = subprocess.Popen([sys.executable, "-c", "pass"])
    job._children["x"].wait()
    back = pickle.loads(pickle.dumps(job))
    assert back.run_dirs == job.run_dirs and back.trusted == ["mymodule"] and back._children == {}


def test_placement_packs_whole_runs():
    runs = [Path(f"/r{k}") for k in range(5)]
    planned = place(runs, "pair", pack=2)
    assert [e.run_dir for e in planned] == runs and all(e.units is None for e in planned)
    assert [tuple(e.run_dir for e in group) for group in jobs_of(planned)] == \
        [(runs[0], runs[1]), (runs[2], runs[3]), (runs[4],)]
    assert planned[4].pack == ()  # a pack of one is a plain pair job
    assert [len(g) for g in jobs_of(place(runs, "pair"))] == [1] * 5


@pytest.mark.parametrize("settings,words", [
    ({"pack": 0}, "launcher.pack=0: must be an integer ≥ 1"),
    ({"pack": 2, "split": "bins"}, "packs whole runs, launcher.split=bins splits one"),
    ({"pack": 4, "gpus_per_node": 2}, "ask for gpus_per_node=4 (or 0 to run on CPUs)"),
    ({"pack": 2, "name": "local"}, "use launcher=slurm (or submitit_local)"),
])
def test_pack_settings_that_cannot_work_are_refused(settings, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check(launcher(**{"name": "submitit_local", "gpus_per_node": 0, **settings}))


def test_launch_json_and_status_name_the_pack(tmp_path):
    runs = [tmp_path / "a", tmp_path / "b"]
    for r in runs:
        planned_run(r)
    paths = SimpleNamespace(folder=tmp_path / "sub", stdout=tmp_path / "o", stderr=tmp_path / "e",
                            result_pickle=tmp_path / "res.pkl")
    job = SimpleNamespace(job_id="4242", paths=paths)
    for r in runs:
        write_launch(r, [(Element(r, None, tuple(runs)), job)], "slurm", launcher(name="slurm", pack=2),
                     "now")
    launched = read_launch(RunDir(runs[1]))
    assert launched["job_id"] == "4242" and launched["pack"] == [str(r) for r in runs]
    line = describe(runs[1], progress(RunIndex.load(runs[1])))
    assert "job 4242 (a pack of 2 runs)" in line


# ----------------------------------------------------------------------------- on the local SLURM


@pytest.mark.slurm
def test_a_sweep_packed_into_one_job_reproduces_each_pair(tmp_path, slurm_args, model_args,  # noqa: F811
                                                          local_reference):  # noqa: F811
    sweep = tmp_path / "sweep"
    proc = run_twinrun(["-m", "+experiment=pin_sigma", *TINY, *model_args, *slurm_args, "launcher.pack=2",
                        "intervention.sigma_pin=0.5,1.2", f"hydra.sweep.dir={sweep}"], cwd=tmp_path,
                       timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launched = [launch_json(sweep / p) for p in ("0", "1")]
    assert launched[0]["job_id"] == launched[1]["job_id"]  # one job for both runs
    assert launched[0]["pack"] == [str((sweep / p).resolve()) for p in ("0", "1")]
    assert f"a pack of 2 runs: {(sweep / '0').resolve()} {(sweep / '1').resolve()}" in proc.stdout
    assert proc.stdout.count("Launching 2 jobs locally") == 0
    assert "submits them together, as one job of 2 runs (launcher.pack=2" in proc.stdout
    for p in ("0", "1"):  # each run fingerprinted its own process, inside the one SLURM job
        jobs = run_json(sweep / p)["jobs"]
        assert [j["slurm_job_id"] for j in jobs] == [launched[0]["job_id"]]
    assert store_sums(sweep / "0") == store_sums(local_reference)  # point 0 is the reference's config
    status = run_twinrun([str(sweep)], cwd=tmp_path, module="twinrun.status")
    assert status.stdout.count("(a pack of 2 runs)") == 2


@pytest.mark.slurm
def test_a_preempted_pack_requeues_whole_and_each_run_resumes(tmp_path, slurm_args, model_args):  # noqa: F811
    # the default 8-bin grid, bins long enough that USR2 lands while both processes measure
    common = ["+experiment=pin_sigma", "probe.n_images=16", "probe.n_draws=16", "probe.n_folds=4",
              *model_args]
    sweep = tmp_path / "sweep"
    job = subprocess.Popen([sys.executable, "-m", "twinrun", "-m", *common, *slurm_args, "launcher.pack=2",
                            "launcher.cpus_per_task=1", "launcher.timeout_min=30", "seed=0,1",  # per run
                            f"hydra.sweep.dir={sweep}"], cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _preempt_mid_run(job, sweep)
        _, err = job.communicate(timeout=600)
    finally:
        job.kill()
    assert job.returncode == 0, err[-3000:]
    launched = launch_json(sweep / "0")
    assert final_state(launched["job_id"]) == "COMPLETED 0:0"
    log = Path(launched["stdout"]).read_text()
    assert "stopping 2 process(es) of the pack; requeueing it whole" in log and "Requeued job" in log
    for p in ("0", "1"):
        jobs = run_json(sweep / p)["jobs"]
        assert len(jobs) == 2 and {j["slurm_job_id"] for j in jobs} == {launched["job_id"]}
        assert RunDir(sweep / p).read_summary()["passed"]
    assert log.count("twinrun: resuming:") == 2  # each run, on the second start, kept its finished bins


def _whole(run_dir: Path) -> int:
    try:
        units = RunIndex.load(run_dir).units
    except Exception:  # noqa: BLE001 — not planned yet
        return 0
    return sum(all(e["status"] == "done" for e in u["stores"].values()) for u in units)


def _preempt_mid_run(job, sweep: Path) -> None:
    """USR2 to the pack's job (what a preemption sends) once both runs have a bin but neither all."""
    deadline = time.time() + 600  # queueing, planning and two processes on a loaded 2-core machine
    while min(_whole(sweep / "0"), _whole(sweep / "1")) < 1:
        assert time.time() < deadline and job.poll() is None, "the pack did not finish a bin of each run"
        time.sleep(0.1)
    assert max(_whole(sweep / "0"), _whole(sweep / "1")) < 8, "a run finished before the signal: lengthen it"
    subprocess.run(["scancel", "--signal=USR2", launch_json(sweep / "0")["job_id"]], check=True)
