"""The device is judged in the job, on the node that measures (issue 23, point 1), and the device's
memory is estimated at plan time and checked before the first bin (point 4). No GPU here: CUDA is faked
where only its answers matter (how many GPUs, how much free memory), never where a kernel would run."""

import types
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_twinrun
from fault_models import OutOfMemoryUnderVmap, tiny_dit
from omegaconf import OmegaConf

from twinrun import launchers
from twinrun.config import LauncherConfig, ProbeConfig
from twinrun.errors import (
    EXIT_DEVICE,
    EXIT_DEVICE_MEMORY,
    EXIT_USAGE,
    ConfigError,
    DeviceError,
    DeviceMemoryError,
)
from twinrun.job import run_job
from twinrun.launchers import wait
from twinrun.measures import fold_sums as fs
from twinrun.measures import probe, probe_cost, trial
from twinrun.measures.kind import parse_device, resolve_device
from twinrun.plan import plan_run, trusted_targets
from twinrun.provenance import determinism
from twinrun.storage.rundir import RunIndex


@pytest.fixture(autouse=True)
def switches_restored():
    """A job applies determinism to the whole process: leave the switches as this test found them."""
    state = determinism._current()
    yield
    determinism._restore(state)


def fake_gpus(monkeypatch, count: int) -> None:
    """torch sees `count` GPUs (only their number and names: nothing may run on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    props = types.SimpleNamespace(name="Fake H200", multi_processor_count=132, major=9, minor=0,
                                  uuid="GPU-fake")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


# ----------------------------------------------------------------------------- the device, judged in the job


@pytest.mark.parametrize("name, want", [("auto", ("auto", None)), ("cpu", ("cpu", None)),
                                        ("cuda", ("cuda", None)), ("cuda:3", ("cuda", 3))])
def test_planning_judges_only_the_spelling_of_the_device(name, want):
    assert parse_device("probe.device", name) == want  # cuda is fine on this GPU-less host


@pytest.mark.parametrize("name", ["meta", "mps", "cuda:x", "cpu:0", "gpu"])
def test_a_device_twinrun_cannot_measure_on_is_one_line_naming_the_key(name):
    with pytest.raises(ConfigError, match=rf"^probe.device='{name}': .*auto, cpu, cuda or cuda:N"):
        parse_device("probe.device", name)


def test_the_job_resolves_the_device_against_the_gpus_it_sees(monkeypatch):
    key = "probe.device"
    assert resolve_device("auto", key=key) == torch.device("cpu")  # this process: no GPU, the CPU
    with pytest.raises(DeviceError, match=r"probe.device=cuda asks for a GPU, but this process sees none") \
            as err:
        resolve_device("cuda", key=key)
    assert err.value.exit_code == EXIT_DEVICE == 5
    # the kind's own settings key is the one named (the job hands it in)
    with pytest.raises(DeviceError, match=r"^sample.device=cuda asks for a GPU.*with sample.device=cpu"):
        resolve_device("cuda", key="sample.device")
    with pytest.raises(DeviceError, match=r"launcher.gpus_per_node=1 asks for a GPU"):
        resolve_device("auto", gpus=1, key=key)  # a GPU was requested and the job sees none: not the CPU
    fake_gpus(monkeypatch, 2)  # e.g. CUDA_VISIBLE_DEVICES=5,7: the job sees them as cuda:0 and cuda:1
    assert resolve_device("auto", key=key) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", key=key) == torch.device("cuda", 1)
    assert resolve_device("auto", gpus=0, key=key) == torch.device("cpu")  # none requested: the CPU
    with pytest.raises(DeviceError, match=r"cuda:2: this process sees 2 GPUs .*cuda:0 to cuda:1"):
        resolve_device("cuda:2", key=key)


def launcher(**settings) -> dict:
    return {**OmegaConf.to_container(OmegaConf.structured(LauncherConfig)), **settings}


def test_a_submitted_job_must_request_the_gpus_its_device_names():
    with pytest.raises(ConfigError, match=r"launcher.gpus_per_node=0: probe.device=cuda needs a GPU"):
        launchers.check(launcher(name="submitit_local", gpus_per_node=0), device=("probe.device", "cuda"))
    with pytest.raises(ConfigError, match=r"device='cuda:1': the job requests launcher.gpus_per_node=1"):
        launchers.check(launcher(name="submitit_local", gpus_per_node=1), device=("probe.device", "cuda:1"))
    launchers.check(launcher(name="submitit_local", gpus_per_node=2), device=("probe.device", "cuda:1"))
    with pytest.raises(ConfigError, match=r"^probe.device='cuda:1': launcher.pack=2 gives each run one GPU"):
        launchers.check(launcher(name="submitit_local", gpus_per_node=2, pack=2),
                        device=("probe.device", "cuda:1"))
    launchers.check(launcher(name="submitit_local", gpus_per_node=2, pack=2), device=("probe.device", "cuda"))
    # In this process: judged where it runs, by the job.
    launchers.check(launcher(name="local", gpus_per_node=0), device=("probe.device", "cuda"))
    note = launchers.device_note(launcher(name="submitit_local", gpus_per_node=0), "probe.device", "auto")
    assert "requests no GPU and will measure on the CPU" in note
    assert launchers.device_note(launcher(name="submitit_local"), "probe.device", "auto") is None


def test_a_gpu_beyond_those_the_job_sees_fails_before_any_unit(tmp_path, compose_cfg, monkeypatch):
    run_dir = tmp_path / "run"
    plan_run(compose_cfg(["+experiment=pin_sigma", *TINY, "probe.device=cuda:3"]), run_dir)  # planned here
    fake_gpus(monkeypatch, 1)
    with pytest.raises(DeviceError) as err:
        run_job(run_dir)
    line = str(err.value)
    assert "probe.device=cuda:3: this process sees 1 GPU " in line and "\n" not in line
    index = RunIndex.load(run_dir)
    assert index.status == "failed" and index.failure["error"] == "device"
    assert index.failure["message"] == line
    assert not list(run_dir.glob("arms/*/*.safetensors")) and not index.jobs  # before any unit and any job
    # A launcher waiting on that job reads the failure as exit 5, as the run would have exited here.
    job = types.SimpleNamespace(job_id="42", paths=types.SimpleNamespace(stderr=Path("42.err")))
    assert wait._report(wait.Submitted(run_dir, None, job), "FAILED", []) == EXIT_DEVICE


@pytest.mark.slow
def test_cuda_on_a_node_without_a_gpu_is_one_line_and_exit_5(tmp_path):
    run_dir = tmp_path / "run"
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so the job finds none on a GPU box too.
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, "probe.device=cuda", f"hydra.run.dir={run_dir}"],
                       cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == EXIT_DEVICE, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("twinrun: error: probe.device=cuda asks for a GPU"), lines
    assert "CUDA_VISIBLE_DEVICES=''" in lines[0] and "Traceback" not in proc.stderr
    assert RunIndex.load(run_dir).failure["message"] == lines[0].removeprefix("twinrun: error: ")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the submitit job would see this machine's GPU")
def test_a_submitted_job_given_a_gpu_it_does_not_see_exits_5(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, "probe.device=auto", "launcher=submitit_local",
                        "launcher.gpus_per_node=1", "launcher.poll_s=0.2", f"hydra.run.dir={run_dir}"],
                       cwd=tmp_path)
    assert proc.returncode == EXIT_DEVICE, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "launcher.gpus_per_node=1 asks for a GPU, but this process sees none" in proc.stderr
    assert RunIndex.load(run_dir).failure["error"] == "device"


@pytest.mark.slow
def test_auto_with_no_gpu_requested_says_it_measures_on_the_cpu(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, "probe.device=auto", "launcher=submitit_local",
                        "launcher.gpus_per_node=0", "launcher.poll_s=0.2", f"hydra.run.dir={run_dir}"],
                       cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "probe.device=auto with launcher.gpus_per_node=0: the job requests no GPU" in proc.stdout
    assert RunIndex.load(run_dir).jobs[0]["device"] == "cpu"  # resolved in the job, and recorded


# ----------------------------------------------------------------------------- device memory


def test_the_estimate_counts_12_bytes_per_fold_and_parameter_in_float64_and_4_in_float32():
    model = tiny_dit()
    images = torch.rand(12, 1, 8, 8)
    folds = torch.arange(4).repeat_interleave(3).tolist()
    n = sum(q.numel() for q in model.parameters())
    p = ProbeConfig(n_images=12, n_folds=4, n_draws=2)
    wide = probe_cost.device_memory(p, model, n, images, folds, "folds", 0)
    narrow = probe_cost.device_memory(ProbeConfig(n_images=12, n_folds=4, n_draws=2,
                                                  accumulator_dtype="float32"), model, n, images, folds,
                                      "folds", 0)
    assert wide.fold_sums == 12 * 4 * n and narrow.fold_sums == 4 * 4 * n
    # The DiT at 20 folds: 12·F·P = 31 GB of fold sums alone.
    assert 12 * 20 * 130_000_000 / 1e9 == pytest.approx(31.2)
    # vmap holds a gradient per fold group of its call, folds one: the call sizes are the probe's own.
    vmap = probe_cost.device_memory(p, model, n, images, folds, "vmap", 0)
    assert vmap.gradients == 4 * wide.gradients == 4 * 4 * n
    assert vmap.samples_per_call == 4 * wide.samples_per_call


def test_the_job_refuses_a_run_its_gpu_cannot_hold_before_the_first_bin(tmp_path, compose_cfg, monkeypatch):
    run_dir = tmp_path / "run"
    plan_run(compose_cfg(["+experiment=pin_sigma", *TINY]), run_dir)
    # The check as the job makes it on a GPU with 1 MiB free (this CPU stands in for the GPU's kernels).
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    real = probe_cost.check_device_memory
    monkeypatch.setattr(probe, "check_device_memory", lambda est, p, _: real(est, p, torch.device("cuda", 0)))
    with pytest.raises(DeviceMemoryError) as err:
        run_job(run_dir)
    line = str(err.value)
    assert err.value.exit_code == EXIT_DEVICE_MEMORY == 6
    assert "more than the 1.0 MiB this process can have" in line
    for knob in ("probe.n_folds=4", "probe.accumulator_dtype", "probe.chunk_images", "probe.chunk_draws",
                 "probe.params", "probe.method=folds"):
        assert knob in line, knob
    index = RunIndex.load(run_dir)
    assert index.failure["error"] == "device_memory" and not list(run_dir.glob("arms/*/*.safetensors"))
    job = types.SimpleNamespace(job_id="42", paths=types.SimpleNamespace(stderr=Path("42.err")))
    assert wait._report(wait.Submitted(run_dir, None, job), "FAILED", []) == EXIT_DEVICE_MEMORY


def test_running_out_of_memory_mid_run_names_the_estimate_and_keeps_earlier_bins(tmp_path, compose_cfg):
    run_dir = tmp_path / "run"
    cfg = compose_cfg(["+experiment=pin_sigma", *TINY,
                       "model._target_=fault_models.out_of_memory_above_sigma"])
    plan_run(cfg, run_dir)
    with pytest.raises(DeviceMemoryError) as err:
        run_job(run_dir, trusted_targets(cfg))
    line = str(err.value)
    assert line.startswith("arm native, bin 2 (σ=1.2): cpu ran out of memory (CUDA out of memory.")
    assert "the estimate was" in line and "probe.n_folds=4" in line and "user code raised" not in line
    index = RunIndex.load(run_dir)
    assert index.failure["error"] == "device_memory" and index.failure["unit_index"] == 2
    assert [u["index"] for u in index.whole_units()] == [0, 1]  # measured before the error: kept, valid


def test_the_trial_never_switches_method_because_of_memory():
    model = OutOfMemoryUnderVmap()
    images = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    names = fs.select_params(model, ["*"])
    arms = {"native": torch.tensor(0.5)}
    # Under auto a model that vmap cannot run takes folds; one that vmap runs out of memory on is refused.
    with pytest.raises(torch.cuda.OutOfMemoryError):
        trial.run_trial(model, names, images, 0.5, arms, "auto")
    assert trial.run_trial(model, names, images, 0.5, arms, "folds")[0] == "folds"


def test_out_of_memory_at_plan_time_is_exit_6_not_the_models_fault(compose_cfg, tmp_path, monkeypatch):
    def oom(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 34359738368 bytes.")

    monkeypatch.setattr(trial, "smoke_test", oom)
    with pytest.raises(DeviceMemoryError, match=r"the trial run at plan time: cpu ran out of memory"):
        plan_run(compose_cfg(["+experiment=pin_sigma", *TINY]), tmp_path / "run", dry_run=True)
    assert EXIT_USAGE != EXIT_DEVICE_MEMORY


def test_a_training_run_asking_for_a_gpu_plans_here_and_its_job_judges_the_gpu(tmp_path, compose_cfg,
                                                                               monkeypatch):
    """train.device is judged as probe.device is: its spelling at plan time (a login node has no GPU),
    the GPU in the job, before any step."""
    run_dir = tmp_path / "run"
    train = ["+experiment=train_scale_lr", "train.steps=2", "train.segment_steps=2", "train.batch_size=8",
             "train.heldout_images=8"]
    with pytest.raises(ConfigError, match=r"^train.device='gpu': "):
        plan_run(compose_cfg([*train, "train.device=gpu"]), tmp_path / "bad")
    plan_run(compose_cfg([*train, "train.device=cuda:3"]), run_dir)  # no GPU here: planned all the same
    fake_gpus(monkeypatch, 1)
    with pytest.raises(DeviceError, match=r"^train.device=cuda:3: this process sees 1 GPU "):
        run_job(run_dir)
    index = RunIndex.load(run_dir)
    assert index.status == "failed" and index.failure["error"] == "device"
    assert not list(run_dir.glob("arms/*/*.safetensors")) and not index.jobs
