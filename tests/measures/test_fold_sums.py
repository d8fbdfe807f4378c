"""The probe's fold sums against a per-sample loop (tests/per_sample.py), independent of the probe's own code
(twinrun.measures.fold_sums)."""

import pytest
import torch
from per_sample import loop_sums

from twinrun.interventions import Native, PinSigma
from twinrun.measures import fold_sums as probe
from twinrun.model import DiTDenoiser

SIGMA = 0.5
# Six images in three folds: of unequal size (1, 2, 3) and not contiguous, or equal and in a row
# (one group per fold: the probe's in-place path).
FOLD_OF_IMAGE = [2, 0, 1, 2, 1, 2]
EQUAL_FOLDS = [0, 0, 1, 1, 2, 2]
N_FOLDS = 3
N_DRAWS = 3
# Float32 tolerance for sums of 18 per-sample gradients computed through different kernels
# (batch of 1 vs batched); accumulation order differs too. Observed max error ≈ 1e-6 relative.
RTOL, ATOL_REL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def setup():
    gen = torch.Generator().manual_seed(0)
    model = DiTDenoiser(width=16, depth=2, heads=2, mlp_ratio=2, sigma_data=0.6)
    with torch.no_grad():  # away from adaLN-Zero's zero init, so every parameter has a gradient
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    images = torch.rand(len(FOLD_OF_IMAGE), 1, 8, 8, generator=gen) * 2 - 1
    eps = torch.randn(len(FOLD_OF_IMAGE), N_DRAWS, 1, 8, 8, generator=gen)
    return model, images, eps


@pytest.fixture(scope="module")
def expected(setup):
    """The loop's sums, computed once per (parameter patterns, σ_cond)."""
    cache = {}

    def get(patterns, sigma_cond, folds=FOLD_OF_IMAGE):
        key = (tuple(patterns), sigma_cond, tuple(folds))
        if key not in cache:
            model, images, eps = setup
            names = probe.select_params(model, patterns)
            cache[key] = loop_sums(model, names, images, eps, SIGMA, sigma_cond, folds)
        return cache[key]

    return get


def run_probe(model, names, images, eps, sigma_cond, chunk_images=-1, chunk_draws=-1, folds=FOLD_OF_IMAGE):
    return probe.fold_sums(model, names, images, eps, SIGMA, torch.tensor(sigma_cond), torch.tensor(folds),
                           N_FOLDS, chunk_images, chunk_draws)


def assert_sums_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL_REL * expected.abs().max().item())


@pytest.mark.parametrize("folds", [FOLD_OF_IMAGE, EQUAL_FOLDS], ids=["unequal_folds", "equal_folds"])
@pytest.mark.parametrize("patterns", [["*"], ["cond_embed.*", "blocks.1.attn.*", "pos_embed"]],
                         ids=["all", "subset"])
@pytest.mark.parametrize("sigma_cond", [SIGMA, 1.2], ids=["native", "pinned"])
def test_fold_sums_equal_the_per_sample_loop(setup, expected, patterns, sigma_cond, folds):
    model, images, eps = setup
    names = probe.select_params(model, patterns)
    want = expected(patterns, sigma_cond, folds)
    assert want.shape == (N_FOLDS, sum(p.numel() for n, p in model.named_parameters() if n in names))
    assert (want.abs().sum(1) > 0).all()
    assert_sums_close(run_probe(model, names, images, eps, sigma_cond, folds=folds), want)


@pytest.mark.parametrize("folds", [FOLD_OF_IMAGE, EQUAL_FOLDS], ids=["unequal_folds", "equal_folds"])
@pytest.mark.parametrize("chunk_images", [1, 3, -1])
@pytest.mark.parametrize("chunk_draws", [1, 2, -1])
def test_chunking_does_not_change_the_sums(setup, expected, chunk_images, chunk_draws, folds):
    model, images, eps = setup
    names = probe.select_params(model, ["*"])
    whole = run_probe(model, names, images, eps, SIGMA, folds=folds)
    chunked = run_probe(model, names, images, eps, SIGMA, chunk_images, chunk_draws, folds=folds)
    assert_sums_close(chunked, expected(["*"], SIGMA, folds))
    assert_sums_close(chunked, whole)


def test_sigma_cond_changes_the_sums(setup):
    model, images, eps = setup
    names = probe.select_params(model, ["*"])
    native = run_probe(model, names, images, eps, SIGMA)
    pinned = run_probe(model, names, images, eps, 1.2)
    assert (pinned - native).norm() > 1e-2 * native.norm()


@pytest.mark.parametrize("folds", [FOLD_OF_IMAGE, EQUAL_FOLDS], ids=["unequal_folds", "equal_folds"])
def test_equal_sigma_cond_gives_bit_identical_sums(setup, folds):
    # At the gate bin the arms feed the same σ_cond by different routes: the sums must be the same bits.
    model, images, eps = setup
    names = probe.select_params(model, ["*"])
    sigma = torch.tensor(SIGMA, dtype=torch.float32)
    arms = [Native().sigma_cond(sigma), PinSigma(SIGMA).sigma_cond(sigma)]
    sums = [probe.fold_sums(model, names, images, eps, SIGMA, s, torch.tensor(folds), N_FOLDS) for s in arms]
    assert torch.equal(sums[0], sums[1])


def test_fold_groups_pack_equal_folds_whole_and_pad_little():
    k, groups = probe.fold_groups([0, 0, 1, 1, 2, 2, 3, 3], 4, chunk_images=-1)
    assert k == 2 and groups == [(0, [0, 1]), (1, [2, 3]), (2, [4, 5]), (3, [6, 7])]
    k, groups = probe.fold_groups(FOLD_OF_IMAGE, N_FOLDS, chunk_images=-1)
    assert sorted(i for _, m in groups for i in m) == list(range(len(FOLD_OF_IMAGE)))
    assert all(FOLD_OF_IMAGE[i] == f for f, m in groups for i in m) and all(len(m) <= k for _, m in groups)
    assert sum(k - len(m) for _, m in groups) <= 0.25 * len(FOLD_OF_IMAGE)


@pytest.mark.parametrize("folds", [FOLD_OF_IMAGE, EQUAL_FOLDS], ids=["unequal_folds", "equal_folds"])
@pytest.mark.parametrize(("chunk_images", "chunk_draws"), [(-1, -1), (1, 2)], ids=["whole", "chunked"])
def test_folds_method_equals_the_loop_and_vmap(setup, expected, folds, chunk_images, chunk_draws):
    # One plain backward per fold chunk: the same fold sums as the vmapped probe, to float32 rounding.
    model, images, eps = setup
    names = probe.select_params(model, ["cond_embed.*", "blocks.1.attn.*", "pos_embed"])
    args = (model, names, images, eps, SIGMA, torch.tensor(1.2), torch.tensor(folds), N_FOLDS, chunk_images,
            chunk_draws)
    plain = probe.fold_sums(*args, method="folds")
    assert_sums_close(plain, expected(["cond_embed.*", "blocks.1.attn.*", "pos_embed"], 1.2, folds))
    assert_sums_close(plain, probe.fold_sums(*args, method="vmap"))
