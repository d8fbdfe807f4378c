"""The probe on CUDA: its methods and branches agree with the CPU, compiled agrees with eager, a diffusers
UNet runs, and a run's determinism record says what it set before CUDA's first use.

Marked `gpu`; skipped cleanly where torch sees no CUDA device. Run on a GPU machine with
`pytest -m gpu` (benchmarks/gpu_check.sh does, with everything else only a GPU shows).
"""

import importlib.util
import json

import pytest
import torch
from conftest import REPO, TINY, run_twinrun
from fault_models import tiny_dit
from per_sample import loop_sums

from twinrun.measures import failures, trial
from twinrun.measures import fold_sums as probe
from twinrun.provenance import determinism
from twinrun.storage.store import read_store

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch sees no GPU)")]

SIGMA = 0.5


@pytest.fixture(autouse=True)
def switches_restored(monkeypatch):
    """Deterministic algorithms on CUDA need cuBLAS's workspace setting (torch checks the variable);
    the switches are left as each test found them."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", determinism.CUBLAS_WORKSPACE_CONFIG)
    state = determinism._current()
    yield
    determinism._restore(state)


def inputs(device, n_images=8):
    gen = torch.Generator().manual_seed(0)
    images = (torch.rand(n_images, 1, 8, 8, generator=gen) * 2 - 1).to(device)
    eps = torch.randn(n_images, 3, 1, 8, 8, generator=gen).to(device)
    return images, eps


def sums_on(device, method, folds, n_folds, forward_of=None, **kwargs):
    model = tiny_dit().to(device)
    images, eps = inputs(device, len(folds))
    names = probe.select_params(model, ["*"])
    forward = None if forward_of is None else forward_of(model, names)
    return probe.fold_sums(model, names, images, eps, SIGMA, torch.tensor(1.2, device=device),
                           torch.tensor(folds, device=device), n_folds, method=method, forward=forward,
                           **kwargs).cpu()


def close(got, want, rtol=1e-3):
    # Another device and kernels: float32 rounding of sums of a few per-sample gradients each.
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-4 * want.abs().max().item())


def test_methods_agree_on_cuda_and_with_the_cpu():
    folds = [0, 0, 1, 1, 2, 2, 3, 3]
    want = sums_on("cpu", "vmap", folds, 4)
    for method in ("vmap", "folds"):
        close(sums_on("cuda", method, folds, 4), want)


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_index_add_branch_on_cuda_equals_the_cpu(deterministic):
    """Unequal folds ([2, 1, 1]) add fold groups with index_add_: on CUDA an atomic add, or with
    deterministic algorithms on a sorted, deterministic one (torch's documented behaviour)."""
    torch.use_deterministic_algorithms(deterministic)
    folds = [0, 0, 1, 2]
    want = sums_on("cpu", "vmap", folds, 3, chunk_images=-1, chunk_draws=-1)
    got = sums_on("cuda", "vmap", folds, 3, chunk_images=-1, chunk_draws=-1)
    close(got, want)
    if deterministic:  # the same bits twice
        assert torch.equal(got, sums_on("cuda", "vmap", folds, 3, chunk_images=-1, chunk_draws=-1))


@pytest.mark.parametrize("mode", ["default", "max-autotune"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_compiled_probe_on_cuda_equals_eager(mode, deterministic):
    """max-autotune also turns on CUDA graphs; with deterministic algorithms on, Inductor's deterministic
    mode skips autotuning: either way the compiled probe must equal the eager one to rounding."""
    torch.use_deterministic_algorithms(deterministic)
    folds = [0, 0, 1, 1, 2, 2, 3, 3]
    eager = sums_on("cuda", "folds", folds, 4)
    def compiled_forward(model, names):
        return trial.prepare(model, names, "folds", mode)

    try:
        compiled = sums_on("cuda", "folds", folds, 4, compiled_forward)
    except Exception as err:  # noqa: BLE001 — Inductor's deterministic mode may refuse: a run names it
        cause = failures.determinism_cause(err)
        assert deterministic and cause is not None, err
        pytest.skip(f"{mode} under deterministic algorithms: {cause} (a run says so, exit 2)")
    close(compiled, eager, rtol=1e-4)


def test_a_diffusers_unet_on_cuda_equals_the_per_sample_loop():
    pytest.importorskip("diffusers")
    spec = importlib.util.spec_from_file_location("edm_diffusers", REPO / "examples" / "diffusers" /
                                                  "edm_diffusers.py")
    edm_diffusers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(edm_diffusers)
    folds = [0, 1, 1, 0]
    model = edm_diffusers.unet()
    images, eps = inputs("cpu", len(folds))
    names = probe.select_params(model, ["*"])
    want = loop_sums(model, names, images, eps[:, :2], SIGMA, 1.2, folds)
    model = model.cuda()
    got = probe.fold_sums(model, names, images.cuda(), eps[:, :2].cuda(), SIGMA, torch.tensor(1.2).cuda(),
                          torch.tensor(folds).cuda(), 2, method="folds").cpu()
    close(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["vmap", "folds"])
def test_the_determinism_record_and_bit_identical_replicates_on_cuda(tmp_path, model_args, method):
    run_dir = tmp_path / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, *model_args, "probe.device=cuda",
                        f"probe.method={method}", "arms.replicate=true", "determinism.enabled=true",
                        f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["checks_passed"] is True
    kernel_path = json.loads(next(run_dir.glob("env/kernel_path-*.json")).read_text())["kernel_path"]
    assert kernel_path["gpu"]["name"] == torch.cuda.get_device_name(0)
    assert kernel_path["probe"]["method"] == method and kernel_path["probe"]["device"] == "cuda"
    job = json.loads((run_dir / "env" / "job000.json").read_text())
    record = job["determinism"]
    # Set before CUDA's first use (cuBLAS reads its workspace setting once): planning never touched CUDA.
    assert record["cuda_initialized"] is False and record["cublas_workspace_config_may_be_ignored"] is False
    assert record["set"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert record["cublas_workspace_config_deterministic"] is True
    switches = kernel_path["switches"]
    assert switches["deterministic_algorithms"] and not switches["cudnn_benchmark"]
    assert not switches["cuda_matmul_allow_tf32"] and not switches["cudnn_allow_tf32"]
    assert "model" in job["sentinel"]["ops"] and "model_backward" not in job["sentinel"]["skipped"]
    assert json.loads((run_dir / "run.json").read_text())["jobs"][0]["device"].startswith("cuda:0 (")
    by_arm = {}
    for path in sorted(run_dir.glob("arms/*/*.safetensors")):
        by_arm.setdefault(path.parent.name, []).append(read_store(path).sums)
    native, again = by_arm["native"], by_arm["native_replicate"]
    assert all(torch.equal(a, b) for a, b in zip(native, again, strict=True))
