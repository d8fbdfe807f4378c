"""The vp sampler (objective=vp: DDIM and its stochastic variant, measures/samplers.py) against known truth
by simulation: on Gaussian data with the exact ε-predictor DDIM converges to the exact probability-flow
ODE solution at first order (Heun's correction faster), takes diffusers' DDIM steps, and its stochastic
variant (η > 0) matches the moments of the exact linear-Gaussian chain, which reach the data's as steps
grow; its noise is asked for per step exactly where it adds any, keyed as EDM's."""

import math

import pytest
import torch

from twinrun.measures import samplers

T = 1000
ABAR = torch.cumprod(1 - torch.linspace(1e-4, 0.02, T, dtype=torch.float64), 0)  # DDPM's linear betas
MU, S = 0.7, 0.5  # the data: N(MU, S²) in every pixel


def exact_eps(x, t):
    """E[ε | x_t] for data N(MU, S²): x_t = √ᾱ·x + √(1−ᾱ)·ε has variance V = ᾱS² + 1 − ᾱ, so
    ε̂ = √(1−ᾱ)·(x_t − √ᾱ·MU)/V."""
    a = ABAR[t.long()].reshape(-1, *([1] * (x.dim() - 1)))
    return ((1 - a).sqrt() * (x.double() - a.sqrt() * MU) / (a * S**2 + 1 - a)).float()


def ode_error(sampler: str, steps: int) -> float:
    """The sampler's largest error against the ODE's exact end: the flow of y = x/√ᾱ in s = √((1−ᾱ)/ᾱ)
    keeps (y − MU)/√(S² + s²), so x_T = ε ends at MU + (ε − √ᾱ_T·MU)·S/√V_T."""
    noise = torch.randn(64, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    out = samplers.integrate("vp", exact_eps, noise, samplers.levels("vp", steps, 0, 0, 0, T), sampler,
                             {"eta": 0.0}, abar=ABAR)
    a = float(ABAR[-1])
    truth = MU + (noise.double() - math.sqrt(a) * MU) * S / math.sqrt(a * S**2 + 1 - a)
    return float((out.double() - truth).abs().max() / truth.abs().max())


def test_ddim_converges_to_the_exact_ode_solution_at_first_order_and_heun_faster():
    coarse, fine = ode_error("euler", 32), ode_error("euler", 128)
    assert fine < 0.02 and 0.6 * 4 < coarse / fine < 1.6 * 4, (coarse, fine)  # 4x the steps: 4x smaller
    heun_coarse, heun_fine = ode_error("heun", 32), ode_error("heun", 128)
    assert heun_fine < fine / 5 and heun_coarse / heun_fine > 5, (heun_coarse, heun_fine)


def test_the_grid_ends_clean_and_starts_at_the_last_training_timestep():
    assert samplers.levels("vp", 4, 0, 0, 0, T) == [999.0, 749.0, 499.0, 249.0, 0.0]
    assert samplers.levels("vp", T, 0, 0, 0, T)[:-1] == [float(t) for t in range(T - 1, -1, -1)]


@pytest.mark.slow  # importing diffusers takes seconds
def test_ddim_takes_diffusers_ddim_steps():
    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.DDIMScheduler(num_train_timesteps=T, beta_start=1e-4, beta_end=0.02,
                                        beta_schedule="linear", timestep_spacing="trailing",
                                        set_alpha_to_one=True, clip_sample=False)
    scheduler.set_timesteps(10)
    grid = samplers.levels("vp", 10, 0, 0, 0, T)
    assert [float(t) for t in scheduler.timesteps] == grid[:-1]
    noise = torch.randn(16, 1, 2, 2, generator=torch.Generator().manual_seed(1))
    x = noise.clone()
    for t in scheduler.timesteps:
        x = scheduler.step(exact_eps(x, torch.full((16,), float(t))), t, x, eta=0.0).prev_sample
    ours = samplers.integrate("vp", exact_eps, noise, grid, "euler", {"eta": 0.0},
                              abar=scheduler.alphas_cumprod.double())
    assert torch.allclose(ours, x, rtol=0, atol=2e-6), float((ours - x).abs().max())


def chain_moments(grid: list[float], eta: float) -> tuple[float, float]:
    """The exact mean and variance the stochastic DDIM chain reaches from x_T ~ N(0, 1) under the exact
    ε̂: each step is x' = A·x + B + s·z (ε̂ is linear in x), so m' = A·m + B and v' = A²·v + s²."""
    m, v = 0.0, 1.0
    abars = [float(ABAR[int(t)]) for t in grid[:-1]] + [1.0]
    for t, a, a_next in zip(grid[:-1], abars[:-1], abars[1:], strict=True):
        def step(x, t=t, a=a, a_next=a_next):
            x = torch.tensor([[[[x]]]], dtype=torch.float64)
            return float(samplers.ddim_step(x, exact_eps(x, torch.tensor([t])).double(), a, a_next, eta,
                                            torch.zeros_like(x)))
        b = step(0.0)
        slope = step(1.0) - b
        noisy = a_next < 1
        s = eta * math.sqrt((1 - a_next) / (1 - a)) * math.sqrt(1 - a / a_next) if noisy else 0.0
        m, v = slope * m + b, slope**2 * v + s**2
    return m, v


def test_the_stochastic_variant_matches_the_exact_chains_moments_and_they_reach_the_data():
    n, steps, eta = 20000, 20, 1.0
    grid = samplers.levels("vp", steps, 0, 0, 0, T)
    gen = torch.Generator().manual_seed(2)
    noise = torch.randn(n, 1, 1, 1, generator=gen)
    step_noise = {k: torch.randn(n, 1, 1, 1, generator=gen) for k in range(steps)}
    out = samplers.integrate("vp", exact_eps, noise, grid, "euler", {"eta": eta},
                             lambda k: step_noise[k], abar=ABAR).double().flatten()
    m, v = chain_moments(grid, eta)
    assert abs(float(out.mean()) - m) < 4 * math.sqrt(v / n), (float(out.mean()), m)
    assert abs(float(out.var()) - v) < 4 * v * math.sqrt(2 / n), (float(out.var()), v)
    # the noise is where the exact chain puts it: without it the variance is the deterministic one
    assert abs(v - chain_moments(grid, 0.0)[1]) > 10 * v * math.sqrt(2 / n)
    # ... and the chain reaches the data's moments as the steps grow
    # (slowly: η = 1 at 10, 100, 1000 steps misses S² by 56%, 12%, 1.6%)
    errors = [abs(chain_moments(samplers.levels("vp", k, 0, 0, 0, T), eta)[1] - S**2) for k in (10, 100, T)]
    assert errors[2] < 0.02 * S**2 and errors[0] > errors[1] > errors[2], errors
    m_fine, _ = chain_moments(samplers.levels("vp", T, 0, 0, 0, T), eta)
    assert abs(m_fine - MU) < 0.001 * MU


def test_the_stochastic_variant_asks_for_keyed_noise_at_every_step_but_the_clean_one():
    grid = samplers.levels("vp", 6, 0, 0, 0, T)
    assert samplers.noised_steps("vp", grid, {"eta": 0.5}) == [0, 1, 2, 3, 4]
    assert samplers.noised_steps("vp", grid, {"eta": 0.0}) == []
    asked = []

    def noise_at(k):
        asked.append(k)
        return samplers.step_noise(0, [0, 1], k, (1, 2, 2))  # keyed (seed, sample, step), as EDM's

    noise = samplers.initial_noise(0, [0, 1], (1, 2, 2))
    a = samplers.integrate("vp", exact_eps, noise, grid, "euler", {"eta": 0.5}, noise_at, abar=ABAR)
    b = samplers.integrate("vp", exact_eps, noise, grid, "euler", {"eta": 0.5}, noise_at, abar=ABAR)
    assert asked == [0, 1, 2, 3, 4] * 2 and torch.equal(a, b)
    c = samplers.integrate("vp", exact_eps, noise, grid, "euler", {"eta": 0.0}, noise_at, abar=ABAR)
    assert asked == [0, 1, 2, 3, 4] * 2 and not torch.equal(a, c)  # η = 0 asks for none
