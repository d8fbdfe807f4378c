"""Launching without SLURM: submitit knobs, bad launcher settings, submitit_local runs, local sweeps, status.

The same paths on a real SLURM are in test_slurm.py.
"""

import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import TINY, run_twinrun
from omegaconf import OmegaConf
from rundirs import planned_run
from submitit.core.utils import FailedJobError

from twinrun.config import LauncherConfig
from twinrun.errors import ConfigError
from twinrun.launchers import check
from twinrun.launchers import wait as waiting
from twinrun.launchers.placement import Element
from twinrun.launchers.slurm import sbatch_refused, unsafe_sbatch_knob
from twinrun.launchers.submit import make_executor, submit
from twinrun.launchers.wait import wait
from twinrun.plan import plan_run
from twinrun.storage.rundir import RunIndex
from twinrun.storage.store import read_store

# Conditioning turns NaN above σ=1: the arm's gradients are non-finite at the last TINY bin (σ=1.2).
FAILING_INTERVENTION = textwrap.dedent("""
    import torch
    from twinrun.interventions import PinSigma

    class NaNAbove(PinSigma):
        '''pin_sigma with a bug: its conditioning is NaN above σ=1.'''
        def sigma_cond(self, sigma):
            out = super().sigma_cond(sigma)
            return torch.where(sigma > 1.0, torch.full_like(out, float("nan")), out)
""")


def launcher(**knobs) -> dict:
    """A resolved launcher config, as the pipeline hands it to twinrun.launchers."""
    return {**dataclasses.asdict(LauncherConfig()), **knobs}


def write_failing_module(directory: Path) -> Path:
    """A user's intervention module outside the package; the job finds it through PYTHONPATH."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tw_failing.py").write_text(FAILING_INTERVENTION)
    return directory


def store_sums(run_dir: Path) -> dict:
    """{(arm, bin file): float32 bytes of the sums} of every store listed done in run.json."""
    index = RunIndex.load(run_dir)

    def sums(u: dict, arm: str) -> bytes:
        return read_store(index.store_path(u, arm), u["stores"][arm]["sha256"]).sums.numpy().tobytes()

    return {(arm, e["file"]): sums(u, arm) for u in index.units for arm, e in u["stores"].items()
            if e["status"] == "done"}


# ----------------------------------------------------------------------------- knobs


@pytest.mark.slurm  # submitit's SlurmExecutor needs `srun` on PATH even to write an sbatch file
def test_every_knob_reaches_sbatch_and_none_is_not_passed(tmp_path):
    knobs = launcher(name="slurm", partition="gpu", qos="high", timeout_min=90, cpus_per_task=3, mem_gb=2,
                     signal_delay_s=100, max_num_timeout=7, additional_parameters={"comment": "twin"},
                     setup=["module load cuda"])
    executor = make_executor(knobs, tmp_path, "twinrun-test")
    script = executor._executor._make_submission_file_text("CMD", "uid")  # the sbatch file submitit sends
    for line in ("--partition=gpu", "--qos=high", "--time=90", "--cpus-per-task=3", "--mem=2GB",
                 "--gpus-per-node=1", "--nodes=1", "--signal=USR2@100", "--comment=twin",
                 "--job-name=twinrun-test", "--open-mode=append"):
        assert f"#SBATCH {line}\n" in script, line
    assert "module load cuda\n" in script
    assert "--account" not in script and "--constraint" not in script  # None: the cluster's default
    assert executor._executor.max_num_timeout == 7
    assert str(executor.folder) == str(tmp_path.resolve() / "submitit" / "%j")


@pytest.mark.slurm  # as above: needs `srun` on PATH
def test_zero_gpus_and_no_memory_are_not_requested(tmp_path):
    script = make_executor(launcher(name="slurm", gpus_per_node=0), tmp_path, "t")._executor \
        ._make_submission_file_text("CMD", "uid")
    assert "--gpus-per-node" not in script and "--gres" not in script and "--mem" not in script


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("knobs, key", [
    ({"name": "pbs"}, "launcher.name"),
    ({"name": "slurm", "split": "arms"}, "launcher.split"),
    ({"name": "local", "split": "bins"}, "launcher.split"),  # in-process: nothing to split across
    ({"name": "slurm", "nodes": 2}, "launcher.nodes"),
    ({"name": "slurm", "cpus_per_task": 0}, "launcher.cpus_per_task"),
    ({"name": "slurm", "gpus_per_node": -1}, "launcher.gpus_per_node"),
    ({"name": "slurm", "mem_gb": 0}, "launcher.mem_gb"),
    ({"name": "slurm", "max_num_timeout": -1}, "launcher.max_num_timeout"),
    ({"name": "submitit_local", "poll_s": 0}, "launcher.poll_s"),
    ({"name": "local", "constraint": "a100"}, "launcher.constraint"),  # would be ignored silently
    ({"name": "submitit_local", "constraint": "a100"}, "launcher.constraint"),
])
def test_impossible_settings_name_the_knob(knobs, key):
    with pytest.raises(ConfigError) as err:
        check(launcher(**knobs))
    assert err.value.key == key and "\n" not in str(err.value)


def fake_scheduler(bin_dir: Path, sinfo_out: str, sinfo_rc: int = 0) -> str:
    """A PATH holding only an sbatch and an sinfo that prints `sinfo_out` (for parsing tests)."""
    bin_dir.mkdir()
    for name, body in (("sbatch", "exit 0"), ("sinfo", f"printf '{sinfo_out}'; exit {sinfo_rc}")):
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(bin_dir)


# Two node kinds: a 2-CPU debug node (about 21 GB, no limit) and 64-CPU GPU nodes limited to 2 days.
SINFO = "debug*|(null)|2|21694|infinite\\ngpu|gpu:a100:4(S:0-1)|64|515000|2-00:00:00\\n"


@pytest.mark.parametrize("knobs, key, says", [
    ({"timeout_min": 2, "signal_delay_s": 120}, "launcher.timeout_min", "timeout_min ≥ 3"),
    ({"partition": "nope"}, "launcher.partition", "choose one of debug, gpu"),
    ({"partition": "debug", "gpus_per_node": 1}, "launcher.gpus_per_node", "partition debug has no GPUs"),
    ({"gpus_per_node": 1}, "launcher.gpus_per_node", "partition debug has no GPUs"),  # the default one
    ({"gpus_per_node": 0, "cpus_per_task": 4}, "launcher.cpus_per_task", "largest node has 2 CPUs"),
    ({"gpus_per_node": 0, "cpus_per_task": 2, "mem_gb": 64}, "launcher.mem_gb", "largest node has 21.2 GB"),
    ({"partition": "gpu", "timeout_min": 3000}, "launcher.timeout_min", "time limit is 2880 min"),
])
def test_slurm_settings_are_checked_against_sinfo(tmp_path, monkeypatch, knobs, key, says):
    monkeypatch.setenv("PATH", fake_scheduler(tmp_path / "bin", SINFO))
    with pytest.raises(ConfigError) as err:
        check(launcher(name="slurm", **knobs))
    assert err.value.key == key and says in str(err.value)


def test_every_resource_problem_of_a_submission_is_reported_at_once(tmp_path, monkeypatch):
    """A wrong partition, GPUs on a CPU partition, too many CPUs and too much memory: one line, each knob
    named with its fix (judged against the default partition where the named one does not exist)."""
    monkeypatch.setenv("PATH", fake_scheduler(tmp_path / "bin", SINFO))
    with pytest.raises(ConfigError) as err:
        check(launcher(name="slurm", partition="nope", gpus_per_node=1, cpus_per_task=64, mem_gb=64))
    said = str(err.value)
    assert err.value.key == "launcher.partition" and "\n" not in said
    for part in ("launcher.partition='nope': no such partition",
                 "launcher.gpus_per_node=1: partition debug has no GPUs",
                 "launcher.cpus_per_task=64: partition debug's largest node has 2 CPUs",
                 "launcher.mem_gb=64: partition debug's largest node has 21.2 GB"):
        assert part in said, part


def test_null_gpus_and_cpus_are_read_from_the_partition(tmp_path, monkeypatch):
    """launcher=slurm's defaults: no GPU asked for where the partition has none, CPUs within its nodes;
    a pack asks for a GPU per run and shares the node's CPUs between its runs."""
    monkeypatch.setenv("PATH", fake_scheduler(tmp_path / "bin", SINFO))
    slurm_yaml = OmegaConf.load(Path(__file__).parents[2] / "conf" / "launcher" / "slurm.yaml")
    assert slurm_yaml.gpus_per_node is None and slurm_yaml.cpus_per_task is None  # what users get
    for knobs, gpus, cpus in (({}, 0, 2), ({"partition": "gpu"}, 1, 4),
                              ({"partition": "gpu", "pack": 2}, 2, 4), ({"pack": 2}, 0, 1),
                              ({"cpus_per_task": 1, "gpus_per_node": 0}, 0, 1)):
        settings = launcher(name="slurm", **{"gpus_per_node": None, "cpus_per_task": None, **knobs})
        check(settings)  # passes: nothing asked for that the partition lacks
        assert (settings["gpus_per_node"], settings["cpus_per_task"]) == (gpus, cpus), knobs
    with pytest.raises(ConfigError, match=r"launcher.cpus_per_task=None: must be a number ≥ 1 with "
                       r"launcher=submitit_local"):
        check(launcher(name="submitit_local", cpus_per_task=None))


def test_a_pack_asks_for_each_runs_cpus_and_memory_and_gives_each_process_its_threads(monkeypatch):
    from twinrun.launchers import jobs
    from twinrun.launchers.submit import executor_parameters

    params = executor_parameters(launcher(name="slurm", pack=3, cpus_per_task=2, mem_gb=5, gpus_per_node=3),
                                 "slurm", "t")
    assert (params["cpus_per_task"], params["mem_gb"], params["gpus_per_node"]) == (6, 15, 3)
    alone = executor_parameters(launcher(name="slurm", cpus_per_task=2, mem_gb=5), "slurm", "t")
    assert (alone["cpus_per_task"], alone["mem_gb"]) == (2, 5)
    started = []
    monkeypatch.setattr(jobs.subprocess, "Popen", lambda argv, env: started.append(env))
    job = jobs.PackedJob(["/a", "/b"], (), 2)
    job._start("/a", "0")
    assert started[0]["OMP_NUM_THREADS"] == "2" and started[0]["CUDA_VISIBLE_DEVICES"] == "0"
    again = jobs.PackedJob.__new__(jobs.PackedJob)
    again.__setstate__(job.__getstate__())  # a requeue keeps each run's share
    assert again.cpus_per_run == 2


def test_a_gpu_partition_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_scheduler(tmp_path / "bin", SINFO))
    check(launcher(name="slurm", partition="gpu", gpus_per_node=4))


def test_no_sbatch_and_a_mute_scheduler_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    with pytest.raises(ConfigError, match="sbatch is not on PATH.*launcher=local"):
        check(launcher(name="slurm"))
    monkeypatch.setenv("PATH", fake_scheduler(tmp_path / "bin", "", sinfo_rc=1))
    with pytest.raises(ConfigError, match="SLURM does not answer"):
        check(launcher(name="slurm"))
    check(launcher(name="submitit_local"))  # needs no scheduler


def test_sbatch_refusal_names_the_knob():
    refusal = FailedJobError("sbatch: error: invalid partition specified: nope\n"
                             "sbatch: error: Batch job submission failed: Invalid partition name specified")
    err = sbatch_refused(refusal, launcher(partition="nope"))
    assert err.key == "launcher.partition" and "Invalid partition name" in str(err)
    err = sbatch_refused(FailedJobError("sbatch: error: Batch job submission failed: Invalid qos"),
                         launcher(qos="gold"))
    assert err.key == "launcher.qos"


@pytest.mark.slow
def test_no_sbatch_on_path_is_exit_2_from_the_cli(tmp_path, model_args):
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, *model_args, "launcher=slurm",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env={"PATH": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1
    assert errors[0].startswith("twinrun: error: launcher='slurm': sbatch is not on PATH")


def test_status_of_a_directory_without_runs_is_exit_2(tmp_path):
    proc = run_twinrun([str(tmp_path)], cwd=tmp_path, module="twinrun.status")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "holds no run.json" in proc.stderr


# ----------------------------------------------------------------------------- submitit_local and local


@pytest.mark.slow
def test_submitit_local_job_equals_the_in_process_run(tmp_path, model_args):
    common = ["+experiment=pin_sigma", *TINY, *model_args]
    local = run_twinrun([*common, f"hydra.run.dir={tmp_path / 'local'}"], cwd=tmp_path)
    job = run_twinrun([*common, "launcher=submitit_local", "launcher.gpus_per_node=0", "launcher.poll_s=0.2",
                       f"hydra.run.dir={tmp_path / 'job'}"], cwd=tmp_path)
    assert job.returncode == local.returncode == 0, job.stderr[-2000:]
    assert "submitted submitit local job" in job.stdout
    assert "units done: pin_sigma 3/3, native 3/3" in job.stdout
    # the job measured in another process: every store's sums are bit-identical to the in-process run
    assert store_sums(tmp_path / "job") == store_sums(tmp_path / "local")
    launched = json.loads((tmp_path / "job" / "launch.json").read_text())
    assert launched["cluster"] == "local" and Path(launched["result"]).is_file()
    assert not (tmp_path / "local" / "launch.json").exists()  # in-process: no job
    status = run_twinrun([str(tmp_path / "job")], cwd=tmp_path, module="twinrun.status")
    assert status.returncode == 0
    assert f"job {launched['job_id']} ENDED; units done: pin_sigma 3/3, native 3/3" in status.stdout


@pytest.mark.slow
def test_local_sweep_runs_point_by_point_and_summarises(tmp_path, model_args):
    sweep = tmp_path / "sweep"
    proc = run_twinrun(["-m", "+experiment=pin_sigma", "intervention.sigma_pin=0.5,1.2", *TINY, *model_args,
                        f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for point in ("0", "1"):
        assert json.loads((sweep / point / "run.json").read_text())["status"] == "measured"
        assert not (sweep / point / "launch.json").exists()
    assert (sweep / "sweep_summary.json").is_file()
    status = run_twinrun([str(sweep)], cwd=tmp_path, module="twinrun.status")
    lines = status.stdout.splitlines()
    assert status.returncode == 0 and len(lines) == 2
    assert all("measured; no job; units done: pin_sigma 3/3, native 3/3" in line for line in lines)
    # after Ctrl-C or launcher.wait=false: the sweep directory is reduced as a whole
    (sweep / "1" / "summary.json").unlink()
    again = run_twinrun([str(sweep)], cwd=tmp_path, module="twinrun.sweep")
    assert again.returncode == 0 and (sweep / "1" / "summary.json").is_file(), again.stderr
    assert json.loads((sweep / "sweep_summary.json").read_text())["all_valid"] is True
    # a point that never ran is marked missing, and the sweep is not "all valid"
    shutil.rmtree(sweep / "1")
    missing = run_twinrun([str(sweep)], cwd=tmp_path, module="twinrun.sweep")
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert missing.returncode == 2 and summary["all_valid"] is False
    assert [p["status"] for p in summary["points"]] == ["reduced", "missing"]
    assert "intervention.sigma_pin=1.2" in summary["points"][1]["overrides"]


def planned(compose_cfg, run_dir: Path, *overrides) -> dict:
    """Plan a run in this process and return its resolved launcher config."""
    cfg = compose_cfg(["+experiment=pin_sigma", *TINY, "launcher=submitit_local", "launcher.gpus_per_node=0",
                       "launcher.poll_s=0.2", *overrides])
    plan_run(cfg, run_dir)
    return OmegaConf.to_container(cfg.launcher, resolve=True)


@pytest.mark.slow
def test_failing_arm_is_reported_with_its_bin_and_exit_1(tmp_path, model_args, compose_cfg, monkeypatch,
                                                          capsys):
    modules = write_failing_module(tmp_path / "user_code")
    monkeypatch.syspath_prepend(str(modules))
    path = [str(modules), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, path)))  # the job's interpreter
    run_dir = tmp_path / "run"
    knobs = planned(compose_cfg, run_dir, *model_args, "intervention._target_=tw_failing.NaNAbove")
    submitted = submit([run_dir], knobs, run_dir, trusted=["tw_failing"])  # the user vouches for it
    assert wait(submitted, knobs) == {run_dir: 1}
    err = capsys.readouterr().err
    assert "arm pin_sigma failed at bin 2 (σ=1.2)" in err and "NonFiniteGradient" in err
    run = json.loads((run_dir / "run.json").read_text())
    assert run["status"] == "failed" and run["failure"] == {"arm": "pin_sigma", "unit_index": 2,
                                                            "unit": "bin 2 (σ=1.2)"}
    # bins 0 and 1 of both arms (+ the gate replicate) stay valid
    # and bin 2's twin, measured first (the pairing receipt), before the intervention failed
    assert len(store_sums(run_dir)) == 2 * 2 + 1 + 1


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@pytest.mark.slow
def test_a_job_killed_without_result_ends_the_wait(tmp_path, model_args, compose_cfg, capsys):
    run_dir = tmp_path / "run"
    knobs = planned(compose_cfg, run_dir, *model_args, "sigma_grid.sigmas=[0.1,0.2,0.35,0.5,0.8,1.2,2.0]",
                    "intervention.sigma_pin=0.5", "probe.n_images=40", "probe.n_draws=12", "probe.n_folds=4")
    ((element, job),) = submit([run_dir], knobs, run_dir)

    def kill_when_running():  # SIGKILL the job's python (the controller's child) once it measures
        deadline = time.time() + 60
        while time.time() < deadline:
            if json.loads((run_dir / "run.json").read_text())["status"] == "running":
                for pid in _children(job._process.pid):
                    os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    t0 = time.time()
    assert wait([(element, job)], knobs) == {run_dir: 2}
    killer.join()
    assert time.time() - t0 < 60
    assert "without a result" in capsys.readouterr().err


def test_status_module_runs_as_a_script(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "twinrun.status", "--help"], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0 and "a run directory, or a sweep directory" in proc.stdout


class _PendingJob:
    job_id = "4242"

    def __init__(self):
        self.cancelled = False

    def cancel(self, check=True):
        self.cancelled = True


@pytest.mark.parametrize("reason, resolves", [("PartitionConfig", False), ("PartitionTimeLimit", False),
                                              ("Resources", True), ("BeginTime", True)])
def test_a_job_pending_for_a_reason_waiting_cannot_resolve_is_cancelled(tmp_path, monkeypatch, capsys, reason,
                                                                         resolves):
    job, run_dir, polls = _PendingJob(), tmp_path / "run", {"n": 0}
    planned_run(run_dir)  # waiting reads each run's progress from its run.json

    def poll(pending):
        polls["n"] += 1
        if polls["n"] > 5:  # a resolvable wait ends (the test stands in for the scheduler)
            return {r: (True, "COMPLETED") for r in pending}
        return {r: (False, f"PENDING ({reason})") for r in pending}

    monkeypatch.setattr(waiting, "_poll", poll)
    monkeypatch.setattr(waiting, "UNRESOLVABLE_GRACE_S", 0.05)
    monkeypatch.setattr(waiting, "_outcome", lambda *a: None)
    monkeypatch.setattr(waiting, "describe", lambda *a: "line")
    monkeypatch.setattr(waiting, "progress", lambda *a, **k: {})
    failed = wait([(Element(run_dir, None), job)], launcher(name="slurm", poll_s=0.03))
    if resolves:
        assert failed == {} and not job.cancelled
        return
    assert failed == {run_dir: 2} and job.cancelled
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and reason in err[0] and "launcher.timeout_min" in err[0], err


@pytest.mark.parametrize("knobs, key", [
    ({"constraint": "a100\ntouch /tmp/x\n#"}, "launcher.constraint"),
    ({"qos": "high\n"}, "launcher.qos"),
    ({"account": 'a"b'}, "launcher.account"),
    ({"additional_parameters": {"comment": "x\nrm -rf ~"}}, "launcher.additional_parameters.comment"),
    ({"additional_parameters": {"x\ny": "1"}}, "launcher.additional_parameters.x\ny"),
])
def test_a_knob_that_would_write_a_shell_line_into_sbatch_is_exit_2(knobs, key):
    with pytest.raises(ConfigError) as err:
        check(launcher(name="slurm", **knobs))
    assert err.value.key == key
    # the user's own options may name paths (not so from launch.json, see test_untrusted)
    assert unsafe_sbatch_knob(launcher(additional_parameters={"export": "ALL,PATH=/opt/bin"}), True) is None


def test_split_bins_with_a_compiled_probe_is_refused_before_planning(tmp_path):
    # the bins' concurrent jobs would compile into one cache and land on different kernel paths
    run_dir = tmp_path / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, "launcher=submitit_local", "launcher.split=bins",
                        "probe.compile=default", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "launcher.split='bins'" in err[0] and "probe.compile='default'" in err[0], err
    assert "launcher.split=pair, or probe.compile=false" in err[0] and not (run_dir / "run.json").exists()
    check(launcher(name="submitit_local", split="bins"), ("probe.compile", False))  # uncompiled: fine
