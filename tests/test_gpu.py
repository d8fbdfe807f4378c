"""The probe on CUDA: its two methods agree, and determinism on gives bit-identical replicates.

Marked `gpu`; skipped cleanly where torch sees no CUDA device. Run on a GPU machine with
`pytest -m gpu tests/test_gpu.py`.
"""

import json

import pytest
import torch
from conftest import TINY, run_twinrun
from fault_models import tiny_dit

from twinrun.measures import fold_sums as probe
from twinrun.storage.store import read_store

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch sees no GPU)")]

SIGMA = 0.5


def inputs(device):
    gen = torch.Generator().manual_seed(0)
    images = (torch.rand(8, 1, 8, 8, generator=gen) * 2 - 1).to(device)
    eps = torch.randn(8, 3, 1, 8, 8, generator=gen).to(device)
    return images, eps, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3], device=device)


def test_methods_agree_on_cuda_and_with_the_cpu():
    sums = {}
    for device, method in (("cuda", "vmap"), ("cuda", "folds"), ("cpu", "vmap")):
        model = tiny_dit().to(device)
        images, eps, folds = inputs(device)
        names = probe.select_params(model, ["*"])
        sums[device, method] = probe.fold_sums(model, names, images, eps, SIGMA,
                                               torch.tensor(1.2, device=device), folds, 4,
                                               method=method).cpu()
    scale = sums["cpu", "vmap"].abs().max().item()
    for key in (("cuda", "vmap"), ("cuda", "folds")):
        # Another device and kernels: float32 rounding of sums of 24 per-sample gradients each.
        torch.testing.assert_close(sums[key], sums["cpu", "vmap"], rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["vmap", "folds"])
def test_determinism_on_gives_bit_identical_replicates_on_cuda(tmp_path, model_args, method):
    run_dir = tmp_path / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *TINY, *model_args, "probe.device=cuda",
                        f"probe.method={method}", "arms.replicate=true", "determinism.enabled=true",
                        f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["checks_passed"] is True
    kernel_path = json.loads(next(run_dir.glob("env/kernel_path-*.json")).read_text())["kernel_path"]
    assert kernel_path["gpus"] and kernel_path["probe"]["method"] == method
    by_arm = {}
    for path in sorted(run_dir.glob("arms/*/*.safetensors")):
        by_arm.setdefault(path.parent.name, []).append(read_store(path).sums)
    native, again = by_arm["native"], by_arm["native_replicate"]
    assert all(torch.equal(a, b) for a, b in zip(native, again, strict=True))
