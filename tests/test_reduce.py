"""The estimand registry's Gram accumulation against a brute-force Gram of the same rows."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from twinrun.estimands import ESTIMANDS, available, column_ranges, grams

N_BINS, N_FOLDS = 4, 5
LAYOUT = [{"name": "a", "offset": 0, "numel": 7, "cond": False},
          {"name": "b", "offset": 7, "numel": 5, "cond": True},
          {"name": "c", "offset": 12, "numel": 9, "cond": False},
          {"name": "d", "offset": 21, "numel": 3, "cond": True}]
P = 24


def fake_run(arms):
    gen = torch.Generator().manual_seed(0)
    stores = {(a, b): SimpleNamespace(sums=torch.randn(N_FOLDS, P, generator=gen), meta={"layout": LAYOUT})
              for a in arms for b in range(N_BINS)}
    run = {"arms": [{"name": a} for a in arms], "bins": [{"index": b} for b in range(N_BINS)]}
    return run, stores


def brute_force(stores, arms, columns):
    """Full Gram over rows (arm, bin, fold), and the residual rows S − mean_b S^native."""
    rows = torch.cat([stores[a, b].sums[:, columns] for a in arms for b in range(N_BINS)]).double()
    mean = torch.stack([stores["native", b].sums[:, columns] for b in range(N_BINS)]).double().mean(0)
    resid = rows - mean.repeat(len(arms) * N_BINS, 1)
    return (rows @ rows.T).numpy(), (resid @ resid.T).numpy()


@pytest.mark.parametrize("arms", [["pin_sigma", "native"], ["pin_sigma", "native", "native_replicate"]])
@pytest.mark.parametrize("chunk_params", [1, 4, 1000])
def test_within_bin_blocks_match_a_brute_force_gram(arms, chunk_params):
    _, stores = fake_run(arms)
    g = grams(arms, N_BINS, stores, "native", list(ESTIMANDS), chunk_params)
    cond_cols = [c for e in LAYOUT if e["cond"] for c in range(e["offset"], e["offset"] + e["numel"])]
    full_all, full_res = brute_force(stores, arms, list(range(P)))
    full_cond, _ = brute_force(stores, arms, cond_cols)
    for b in range(N_BINS):
        for i in range(len(arms)):
            for j in range(len(arms)):
                ri = slice((i * N_BINS + b) * N_FOLDS, (i * N_BINS + b + 1) * N_FOLDS)
                rj = slice((j * N_BINS + b) * N_FOLDS, (j * N_BINS + b + 1) * N_FOLDS)
                # grams returns the same-bin blocks as [bin, arm, fold, arm, fold]
                np.testing.assert_allclose(g["all"][b, i, :, j], full_all[ri, rj], rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(g["cond"][b, i, :, j], full_cond[ri, rj], rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(g["residual"][b, i, :, j], full_res[ri, rj], rtol=1e-10, atol=1e-10)


def test_an_estimand_is_one_registry_entry_selecting_columns():
    assert available(LAYOUT) == list(ESTIMANDS)
    assert available([{**e, "cond": False} for e in LAYOUT]) == ["all", "residual"]
    # contiguous columns read by the same estimands are merged into one range
    assert column_ranges(LAYOUT, ["all", "cond"]) == [(0, 7, ("all",)), (7, 12, ("all", "cond")),
                                                     (12, 21, ("all",)), (21, 24, ("all", "cond"))]
