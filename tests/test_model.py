"""The default denoiser: shapes, the sigma/sigma_cond split, parameter naming, vmap+grad, committed
weights."""

from __future__ import annotations

import json
from fnmatch import fnmatch

import pytest
import torch
from torch.func import functional_call, grad, vmap

from twinrun.data import N_HELDOUT, heldout_indices, load_digits_images, sigma_data_of, train_indices
from twinrun.model import (
    COND_PARAM_PATTERNS,
    DEFAULT_ARCH,
    AdaLNModulation,
    DiTDenoiser,
    is_cond_param,
    load_pretrained,
    read_weights,
    save_pretrained,
)

SIGMA_DATA = 0.75


def randomized_model(seed: int = 0, **arch) -> DiTDenoiser:
    """A model with every parameter random, so no adaLN-Zero zeros hide a dependence."""
    model = DiTDenoiser(**{**DEFAULT_ARCH, **arch}, sigma_data=SIGMA_DATA)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    return model.eval()


def sample_batch(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 1, 8, 8, generator=gen)
    sigma = torch.exp(torch.randn(batch, generator=gen))
    return x, sigma


def expected_cond_names(model: DiTDenoiser) -> set[str]:
    """Conditioning parameters found from the module structure, independently of the patterns."""
    names = {f"cond_embed.{n}" for n, _ in model.cond_embed.named_parameters()}
    for module_name, module in model.named_modules():
        if isinstance(module, AdaLNModulation):
            names |= {f"{module_name}.{n}" for n, _ in module.named_parameters()}
    return names


def test_data_split_and_scale():
    images = load_digits_images()
    assert images.shape == (1797, 1, 8, 8) and images.dtype == torch.float32
    assert images.min() >= -1.0 and images.max() <= 1.0
    train, held = train_indices(len(images)), heldout_indices(len(images))
    assert len(held) == N_HELDOUT and held[-1] == len(images) - 1
    assert len(train) + len(held) == len(images) and set(train.tolist()).isdisjoint(held.tolist())
    assert 0.5 < sigma_data_of(images[train]) < 1.0


def test_output_shape_and_default_size():
    x, sigma = sample_batch(3)
    model = randomized_model()
    assert model(x, sigma).shape == x.shape
    n_params = sum(p.numel() for p in model.parameters())
    assert 40_000 <= n_params <= 55_000, n_params
    wide = DiTDenoiser(
        img_resolution=8, img_channels=2, patch_size=4, width=16, depth=1, heads=2, mlp_ratio=2
    )
    x2 = torch.randn(2, 2, 8, 8)
    assert wide(x2, torch.ones(2)).shape == x2.shape


def test_sigma_cond_defaults_to_sigma_and_changes_output():
    x, sigma = sample_batch(4)
    model = randomized_model()
    with torch.no_grad():
        torch.testing.assert_close(model(x, sigma), model(x, sigma, sigma_cond=sigma), rtol=0, atol=0)
        pinned = model(x, sigma, sigma_cond=torch.full_like(sigma, 0.3))
        assert (pinned - model(x, sigma)).abs().max() > 1e-3


def test_preconditioning_does_not_read_sigma_cond():
    """With the conditioning pathway zeroed, sigma_cond has no route to the output; sigma still does."""
    x, sigma = sample_batch(4)
    model = randomized_model()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_cond_param(name):
                param.zero_()
        out_a = model(x, sigma, sigma_cond=torch.full_like(sigma, 0.05))
        out_b = model(x, sigma, sigma_cond=torch.full_like(sigma, 20.0))
        torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
        out_other_sigma = model(x, 2.0 * sigma, sigma_cond=torch.full_like(sigma, 0.05))
        assert (out_a - out_other_sigma).abs().max() > 1e-3


def test_cond_patterns_match_exactly_the_conditioning_pathway():
    model = randomized_model()
    all_names = {n for n, _ in model.named_parameters()}
    matched = {n for n in all_names if any(fnmatch(n, pat) for pat in COND_PARAM_PATTERNS)}
    assert matched == expected_cond_names(model)
    assert matched and matched != all_names
    assert "final.adaln.linear.weight" in matched and "final.linear.weight" not in matched


def per_sample_loss(params: dict, model: DiTDenoiser, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    denoised = functional_call(model, params, (x.unsqueeze(0), sigma.reshape(1)))
    return (denoised - x.unsqueeze(0)).square().sum()


# float64 shows the computations agree; float32 (what the probe runs) may differ by reduction order only.
@pytest.mark.parametrize(("dtype", "rel_tol"), [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_vmap_grad_matches_per_sample_loop(dtype, rel_tol):
    x, sigma = (t.to(dtype) for t in sample_batch(3))
    model = randomized_model().to(dtype)
    params = {n: p.detach() for n, p in model.named_parameters()}
    batched = vmap(grad(per_sample_loss), in_dims=(None, None, 0, 0))(params, model, x, sigma)
    for i in range(x.shape[0]):
        single = grad(per_sample_loss)(params, model, x[i], sigma[i])
        for name in params:
            scale = float(single[name].abs().max()) + 1e-12
            torch.testing.assert_close(batched[name][i], single[name], rtol=rel_tol, atol=rel_tol * scale)


def test_save_load_roundtrip(tmp_path):
    model = randomized_model(seed=3)
    path = save_pretrained(model, tmp_path / "w.safetensors", {"seed": "3"})
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no temp file left behind
    loaded = load_pretrained(path)
    x, sigma = sample_batch(2)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, sigma), model(x, sigma), rtol=0, atol=0)
    assert not loaded.training and all(
        p.requires_grad and p.dtype == torch.float32 for p in loaded.parameters()
    )


def test_missing_and_broken_weights_name_path_and_fix(tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError, match="python -m twinrun.train") as info:
        load_pretrained(missing)
    assert str(missing) in str(info.value) and "\n" not in str(info.value)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="python -m twinrun.train") as info:
        load_pretrained(broken)
    assert str(broken) in str(info.value) and "\n" not in str(info.value)


def test_training_is_deterministic(tmp_path):
    from twinrun.train import main

    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    for path in paths:
        main(["--steps", "3", "--seed", "5", "--out", str(path)])
    (tensors_a, meta_a), (tensors_b, meta_b) = (read_weights(p) for p in paths)
    assert meta_a["command"] == f"python -m twinrun.train --steps 3 --seed 5 --out {paths[0]}"
    assert meta_a["heldout_denoising"] == meta_b["heldout_denoising"]
    for name in tensors_a:
        assert torch.equal(tensors_a[name], tensors_b[name]), name


def test_committed_weights_denoise_better_than_identity():
    _, metadata = read_weights()
    assert {"arch", "seed", "steps", "command", "torch_version", "heldout_denoising"} <= metadata.keys()
    model = load_pretrained()
    images = load_digits_images()
    clean = images[heldout_indices(len(images))[:32]]
    gen = torch.Generator().manual_seed(0)
    sigma = 1.0
    noisy = clean + sigma * torch.randn(clean.shape, generator=gen)
    with torch.no_grad():
        mse_model = (model(noisy, torch.full((len(clean),), sigma)) - clean).square().mean()
    assert mse_model < 0.5 * sigma**2, float(mse_model)
    assert json.loads(metadata["heldout_denoising"])["1"]["ratio"] < 0.5
