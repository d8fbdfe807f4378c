"""The vmap method's other branch: when a call's fold groups are not one per fold in a row (a fold split
into several groups), their gradients are added with index_add_. Equal folds never reach it; unequal
ones do (4 images in 3 folds: [2, 1, 1], one image per group). tests/e2e/test_gpu.py runs it on CUDA."""

import pytest
import torch
from fault_models import tiny_dit
from per_sample import loop_sums

from twinrun.measures import fold_sums as fs
from twinrun.measures.probe import fold_sizes

FOLDS = torch.repeat_interleave(torch.arange(3), torch.tensor(fold_sizes(4, 3))).tolist()


def test_unequal_folds_take_the_index_add_branch():
    assert FOLDS == [0, 0, 1, 2]
    k, groups = fs.fold_groups(FOLDS, 3, -1)
    assert k == 1 and [f for f, _ in groups] == [0, 0, 1, 2]  # fold 0 twice in one call: not a row of folds


@pytest.mark.parametrize("accumulator", ["float64", "float32"])
def test_the_index_add_branch_equals_the_per_sample_loop(monkeypatch, accumulator):
    calls = []
    real = torch.Tensor.index_add_
    monkeypatch.setattr(torch.Tensor, "index_add_", lambda self, *a: calls.append(1) or real(self, *a))
    model = tiny_dit()
    gen = torch.Generator().manual_seed(0)
    images, eps = torch.rand(4, 1, 8, 8, generator=gen) * 2 - 1, torch.randn(4, 3, 1, 8, 8, generator=gen)
    names = fs.select_params(model, ["*"])
    got = fs.fold_sums(model, names, images, eps, 0.5, torch.tensor(1.2), torch.tensor(FOLDS), 3, -1, -1,
                       method="vmap", accumulator=fs.ACCUMULATORS[accumulator])
    assert calls, "the index_add_ branch did not run"
    want = loop_sums(model, names, images, eps, 0.5, 1.2, FOLDS)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
