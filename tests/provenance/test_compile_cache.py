"""probe.compile: the compiled probe equals the eager one to float32 rounding, the kernel path and
the sentinel see the compiled path, a resume reuses the run's own cache, and a wiped cache is another
kernel path. Inductor's C++ backend compiles on a CPU (gcc), tens of seconds per graph here: slow.
The first test runs on CUDA too where torch sees a GPU (marked `gpu`: Triton kernels, CUDA graphs)."""

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_twinrun
from fault_models import tiny_dit

from twinrun.errors import EXIT_OK, EXIT_REFUSED
from twinrun.measures import fold_sums as probe
from twinrun.measures import trial
from twinrun.provenance import record as provenance

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parents[1]
NO_GPU = not torch.cuda.is_available()
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(NO_GPU, reason="needs CUDA (no GPU)")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_compiled_probe_equals_eager_and_the_sentinel_sees_it(device):
    model = tiny_dit().to(device)
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(4, 1, 8, 8, generator=gen).to(device)
    eps = torch.randn(4, 3, 1, 8, 8, generator=gen).to(device)
    names = probe.select_params(model, ["*"])
    folds = torch.tensor([0, 0, 1, 1], device=device)
    args = (model, names, images, eps, 0.5, torch.tensor(1.2, device=device), folds, 2)
    eager = probe.fold_sums(*args, method="folds")
    compiled = trial.prepare(model, names, "folds", "default")
    assert compiled is not model
    got = probe.fold_sums(*args, method="folds", forward=compiled)
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-5 * eager.abs().max().item())
    shape = tuple(images.shape[1:])
    on_compiled = provenance.read_sentinel(compiled, torch.device(device), shape)
    on_eager = provenance.read_sentinel(model, torch.device(device), shape)
    # Fused kernels round differently: the sentinel's model op tells the compiled path from the eager one
    # (on this CPU; on a GPU they may round alike, but nothing else of the battery may move).
    differ = {k for k in on_eager["ops"] if on_eager["ops"][k] != on_compiled["ops"][k]}
    assert differ == {"model"} if device == "cpu" else differ <= {"model"}


def test_resume_reuses_the_cache_and_a_wiped_cache_is_refused(tmp_path):
    cache, run_dir = tmp_path / "compile_cache", tmp_path / "run"
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    args = ["+experiment=pin_sigma", *TINY, "model._target_=fault_models.tiny", "probe.compile=default",
            f"determinism.compile_cache_dir={cache}", f"hydra.run.dir={run_dir}"]

    def run():
        t0 = time.perf_counter()
        proc = run_twinrun(args, cwd=tmp_path, env=env)
        print(f"exit {proc.returncode} after {time.perf_counter() - t0:.0f} s")
        return proc

    def drop_last_bin():
        for store in run_dir.glob("arms/*/bin02_*.safetensors"):
            store.unlink()

    cold = run()
    assert cold.returncode == EXIT_OK, cold.stderr[-2000:]
    # compiling: auto takes folds without a vmap trial
    assert "probe.method=auto chose folds" not in cold.stdout
    (path,) = run_dir.glob("env/kernel_path-*.json")
    compile_path = json.loads(path.read_text())["kernel_path"]["compile"]
    assert compile_path["mode"] == "default" and compile_path["caches"]["inductor"] != "absent"
    assert json.loads(path.read_text())["kernel_path"]["probe"]["method"] == "folds"
    drop_last_bin()
    warm = run()  # same cache: no new entries, same digest, the bin is measured again
    assert warm.returncode == EXIT_OK, warm.stderr[-2000:]
    assert "resuming: 2 of 3 bins already measured" in warm.stdout
    shutil.rmtree(cache)
    drop_last_bin()
    wiped = run()  # recompiled into a fresh cache: another kernel path than the finished bins
    assert wiped.returncode == EXIT_REFUSED, wiped.stderr[-2000:]
    assert "compile.caches.inductor" in wiped.stderr
