"""benchmarks/bench_gpu.py --smoke: the GPU benchmark's whole flow in seconds on the CPU, as the device
script runs it on a GPU (folds checked against vmap, the floor at the probe's own call size)."""

import importlib.util
import json
import subprocess
import sys

import torch
from conftest import REPO

_spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "benchmarks" / "bench_gpu.py")
bench_gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_gpu)


def test_the_smoke_run_measures_both_methods_and_checks_folds_against_vmap(tmp_path):
    out = tmp_path / "smoke.json"
    script = REPO / "benchmarks" / "bench_gpu.py"
    done = subprocess.run([sys.executable, str(script), "--smoke", "--json", str(out)], capture_output=True,
                          text=True, cwd=tmp_path, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"vmap", "folds"} and rows["folds"]["checked_against"] == "eager vmap"
    assert rows["folds"]["ok"] and rows["folds"]["max_abs_diff_over_max"] < bench_gpu.RTOL
    # The floor runs at the probe's own call size: vmap batches its groups, folds takes one at a time.
    assert rows["vmap"]["samples_per_call"] == 4 * rows["folds"]["samples_per_call"] == 32
    assert all(r["floor_samples_per_call"] == r["samples_per_call"] for r in rows.values())


def test_a_disagreement_beyond_rounding_fails_the_check():
    want = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    assert bench_gpu.agreement(want + 1e-7 * want.abs().max(), want)["ok"]
    assert not bench_gpu.agreement(want * 1.01, want)["ok"]


def test_the_floor_leaves_no_gradient_buffers_behind():
    arch = bench_gpu.SMOKE["smoke_16tok"][0]
    model = bench_gpu.build(arch, torch.device("cpu"))
    images, eps, _ = bench_gpu.inputs(arch, bench_gpu.SMOKE_PROTOCOL, torch.device("cpu"))
    names = [n for n, _ in model.named_parameters()]
    total, largest = bench_gpu.plain_backward(model, model, names, images, eps, 8)
    assert largest == 8 and total.abs().sum() > 0 and all(p.grad is None for p in model.parameters())
