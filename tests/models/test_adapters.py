"""twinrun's adapters of diffusers' text-conditioned networks (twinrun/models): each maps twinrun's call
forward(x_t, level, level_cond, **cond) to the network's own conventions, each image reads its own
conditioning, the conditioning pathway is named, and a local pretrained directory loads. Skipped where
diffusers is not installed."""

import fnmatch

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers import DDPMScheduler

from twinrun.errors import ConfigError
from twinrun.measures import fold_sums as fs
from twinrun.models import pixart, sd3
from twinrun.objectives import OBJECTIVES

M, L = 5, 7  # images, text tokens


def inputs(kind: str, seed: int = 0):
    """Latents [M, 4, 8, 8], levels [M] in the objective's units, and each image's own conditioning."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 4, 8, 8, generator=gen)
    cond = {"encoder_hidden_states": torch.randn(M, L, 16, generator=gen)}
    if kind == "sd3":
        cond["pooled_projections"] = torch.randn(M, 16, generator=gen)
        level = torch.rand(M, generator=gen) * 0.9 + 0.05  # flow: t in (0, 1)
    else:
        mask = torch.ones(M, L, dtype=torch.long)
        mask[3:, 4:] = 0  # two images with padded prompts
        cond["encoder_attention_mask"] = mask
        level = torch.randint(0, 1000, (M,), generator=gen).float()  # vp: a timestep
    return x, level, cond


BUILDERS = {"sd3": sd3.sd3, "pixart": pixart.pixart}


@pytest.mark.parametrize("kind", ["sd3", "pixart"])
def test_the_batched_call_equals_a_per_image_loop_with_each_images_own_conditioning(kind):
    model = BUILDERS[kind]()
    x, level, cond = inputs(kind)
    batched = model(x, level, level, **cond)
    for i in range(M):
        one = slice(i, i + 1)
        own = model(x[one], level[one], level[one], **{k: v[one] for k, v in cond.items()})
        torch.testing.assert_close(batched[i : i + 1], own, rtol=1e-5, atol=1e-5)
    # the conditioning reaches the network: another image's text changes this image's output
    swapped = {k: v.roll(1, 0) for k, v in cond.items()}
    assert (model(x, level, level, **swapped) - batched).abs().amax(dim=(1, 2, 3)).min() > 1e-3


def test_sd3_reads_t_cond_as_its_timestep_times_1000_and_predicts_from_the_raw_network():
    model = sd3.sd3()
    x, t, cond = inputs("sd3")
    want = model.net(hidden_states=x, encoder_hidden_states=cond["encoder_hidden_states"],
                     pooled_projections=cond["pooled_projections"], timestep=1000 * t).sample
    torch.testing.assert_close(model(x, t, t, **cond), want, rtol=0, atol=0)
    # only t_cond reaches the network (t is carried by the noisy input): pinning it changes the output
    assert torch.equal(model(x, t * 0.5, t, **cond), want)
    assert not torch.equal(model(x, t, t * 0.5, **cond), want)


def test_pixart_declares_its_schedule_and_masks_padding_out_of_the_cross_attention():
    model = pixart.pixart()
    want = DDPMScheduler(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02, beta_schedule="linear")
    assert torch.equal(model.alphas_cumprod, want.alphas_cumprod.double())
    x, t, cond = inputs("pixart")
    out = model(x, t, t, **cond)
    noisy_padding = dict(cond, encoder_hidden_states=cond["encoder_hidden_states"].clone())
    noisy_padding["encoder_hidden_states"][3:, 4:] += 100.0  # only the masked tokens change
    torch.testing.assert_close(model(x, t, t, **noisy_padding), out, rtol=1e-5, atol=1e-5)
    noisy_padding["encoder_hidden_states"][3:, :4] += 1.0  # a real token: the output moves
    assert (model(x, t, t, **noisy_padding)[3:] - out[3:]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["sd3", "pixart"])
def test_the_conditioning_pathway_is_named_and_is_not_everything(kind):
    model = BUILDERS[kind]()
    names = [n for n, _ in model.named_parameters()]
    cond = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in fs.cond_patterns(model))]
    assert cond and len(cond) < len(names)
    for pattern in model.COND_PARAM_PATTERNS:  # every pattern names something: no dead spelling
        assert any(fnmatch.fnmatchcase(n, pattern) for n in names), pattern
    module = sd3 if kind == "sd3" else pixart
    for pattern in module.TEXT_PARAM_PATTERNS:
        assert any(fnmatch.fnmatchcase(n, pattern) for n in names), pattern
    # the timestep pathway: every parameter on it gets a gradient from t_cond alone
    x, level, c = inputs(kind)
    t_cond = level.clone().requires_grad_(True)
    model(x, level, t_cond, **c).square().sum().backward()
    assert t_cond.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["sd3", "pixart"])
def test_a_seed_draws_the_network_and_leaves_the_global_generators_alone(kind):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b, c = BUILDERS[kind](seed=0), BUILDERS[kind](seed=0), BUILDERS[kind](seed=1)
    assert torch.equal(torch.random.get_rng_state(), before)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


@pytest.mark.parametrize("kind", ["sd3", "pixart"])
def test_a_local_pretrained_directory_loads_in_place_of_the_random_init(kind, tmp_path):
    drawn = BUILDERS[kind](seed=7)
    drawn.net.save_pretrained(tmp_path / "ckpt" / "transformer")
    loaded = BUILDERS[kind](pretrained=str(tmp_path / "ckpt"), subfolder="transformer")
    x, level, cond = inputs(kind)
    assert torch.equal(loaded(x, level, level, **cond), drawn(x, level, level, **cond))
    with pytest.raises(ConfigError) as err:
        BUILDERS[kind](pretrained=str(tmp_path / "nowhere"))
    assert str(err.value).startswith("model.pretrained=") and "never downloads" in str(err.value)


# ----------------------------------------------------------------------------- the probe's fold sums


def loop_sums(model, names, x, eps, level, level_cond, cond, folds, kind):
    """One forward and backward per (image, draw), each with its own image's conditioning; written from
    the objectives' formulas, independently of twinrun.measures.fold_sums."""
    params = dict(model.named_parameters())
    out = torch.zeros(max(folds) + 1, sum(params[n].numel() for n in names), dtype=torch.float64)
    for i, fold in enumerate(folds):
        for d in range(eps.shape[1]):
            one, e = x[i : i + 1], eps[i, d : d + 1]
            if kind == "sd3":  # flow: x_t = (1 − t)x + tε, target ε − x
                noisy, target = (1 - level) * one + level * e, e - one
            else:  # vp: x_t = √ᾱ x + √(1 − ᾱ) ε, target ε
                abar = model.alphas_cumprod[int(level)]
                noisy, target = abar.sqrt().float() * one + (1 - abar).sqrt().float() * e, e
            model.zero_grad(set_to_none=True)
            pred = model(noisy, torch.tensor([level]), torch.tensor([level_cond]),
                         **{k: v[i : i + 1] for k, v in cond.items()})
            ((pred - target) ** 2).mean().backward()
            out[fold] += torch.cat([params[n].grad.flatten() for n in names]).double()
    model.zero_grad(set_to_none=True)
    return out.float()


@pytest.mark.parametrize(("kind", "method"), [("sd3", "vmap"), ("sd3", "folds"), ("pixart", "folds")])
def test_fold_sums_equal_a_per_sample_loop_with_each_images_own_conditioning(kind, method):
    model = BUILDERS[kind]()
    x, _, cond = inputs(kind)
    folds = [0, 1, 1, 0, 1]
    eps = torch.randn(M, 2, *x.shape[1:], generator=torch.Generator().manual_seed(5))
    level, level_cond = (0.4, 0.7) if kind == "sd3" else (300.0, 600.0)
    names = fs.select_params(model, ["*"])
    want = loop_sums(model, names, x, eps, level, level_cond, cond, folds, kind)
    objective = OBJECTIVES["flow" if kind == "sd3" else "vp"]()
    got = fs.fold_sums(model, names, x, eps, level, torch.tensor(level_cond), torch.tensor(folds), 2,
                       method=method, objective=objective, cond=cond)
    assert (want.abs().sum(1) > 0).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
