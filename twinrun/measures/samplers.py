"""The samplers twin sampling runs (measure=sample), one ODE per objective: under `edm`, EDM's
deterministic Heun and Euler samplers and their stochastic variant (Karras et al. 2022, Algorithms 1
and 2); under `flow`, the rectified-flow ODE dx/dt = v(x, t) from t = 1 to 0 (Euler or Heun); under `vp`,
DDIM on the model's ᾱ (Song et al. 2021): `euler` is DDIM itself (η = 0 deterministic, η > 0 its
stochastic variant), `heun` adds Heun's second-order correction to the deterministic DDIM step. All on
keyed noise.

Every random number a sample consumes is a pure function of (seed, sample index[, step]) — its initial
noise and, with s_churn > 0 (edm) or eta > 0 (vp), its noise at each step that adds noise — drawn on the
CPU (twinrun/draws.py) and only then moved to the device. So every arm, any chunking and a resume see the
same noise for the same sample, and the arms differ only by what the intervention does to the denoiser.

A sampler here takes the arm's model as a function of (x, level) — with its level_cond, hooks and each
sample's conditioning bound by the caller — and the objective's grid of levels (`levels`): D(x; σ)
on EDM's σ schedule, the velocity v(x, t) on a uniform t grid for flow, the noise ε(x_t, t) on a grid of
the model's timesteps for vp. ODES names the objectives a sampler exists for.
"""

import itertools
import math
from collections.abc import Callable

import torch

from twinrun.draws import keyed_normal

INIT_STREAM = b"twinrun/sample-init/v1"
STEP_STREAM = b"twinrun/sample-step/v1"


def edm_sigmas(steps: int, sigma_min: float, sigma_max: float, rho: float) -> list[float]:
    """EDM's schedule (eq. 5): `steps` noise levels from σ_max down to σ_min, then 0, in float64."""
    if steps == 1:
        return [float(sigma_max), 0.0]
    inv = 1.0 / rho
    span = sigma_min**inv - sigma_max**inv
    out = [(sigma_max**inv + i / (steps - 1) * span) ** rho for i in range(steps)]
    return [*map(float, out), 0.0]


def initial_noise(seed: int, sample_ids: list[int], shape: tuple) -> torch.Tensor:
    """[len(sample_ids), *shape]: each sample's initial noise (unit variance; the sampler scales it)."""
    return torch.stack([keyed_normal(INIT_STREAM, seed, (i,), shape) for i in sample_ids])


def step_noise(seed: int, sample_ids: list[int], step: int, shape: tuple) -> torch.Tensor:
    """[len(sample_ids), *shape]: each sample's stochastic-sampler noise at one step."""
    return torch.stack([keyed_normal(STEP_STREAM, seed, (i, step), shape) for i in sample_ids])


def gamma_of(sigma: float, steps: int, s_churn: float, s_tmin: float, s_tmax: float) -> float:
    """How much noise EDM's stochastic sampler adds back at this step (0: a deterministic step)."""
    return min(s_churn / steps, math.sqrt(2.0) - 1.0) if s_tmin <= sigma <= s_tmax and s_churn > 0 else 0.0


def sample(denoise: Callable, noise: torch.Tensor, sigmas: list[float], sampler: str, churn: dict,
           noise_at: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
    """The samples [B, *shape] the sampler reaches from `noise` (unit variance, scaled by σ_0).

    sampler: heun | euler. churn: s_churn, s_tmin, s_tmax, s_noise (s_churn 0: deterministic).
    noise_at(k): the batch's keyed noise at step k, drawn only when that step adds noise."""
    steps = len(sigmas) - 1
    x = noise.to(torch.float64) * sigmas[0]
    for k, (s_cur, s_next) in enumerate(itertools.pairwise(sigmas)):
        gamma = gamma_of(s_cur, steps, churn["s_churn"], churn["s_tmin"], churn["s_tmax"])
        s_hat = s_cur * (1.0 + gamma)
        if gamma > 0:  # Algorithm 2: move up to σ̂ with fresh noise of the right variance
            eps = noise_at(k).to(x.device, torch.float64) * churn["s_noise"]
            x = x + math.sqrt(s_hat**2 - s_cur**2) * eps
        d = (x - _denoised(denoise, x, s_hat)) / s_hat
        x_next = x + (s_next - s_hat) * d
        if sampler == "heun" and s_next > 0:  # the 2nd-order correction (not at the last step to σ = 0)
            d_next = (x_next - _denoised(denoise, x_next, s_next)) / s_next
            x_next = x + (s_next - s_hat) * (0.5 * d + 0.5 * d_next)
        x = x_next
    return x.float()


def _denoised(denoise: Callable, x: torch.Tensor, sigma: float) -> torch.Tensor:
    """D(x; σ) in float64 from a float32 model: the sampler's state is float64, the network's float32."""
    sig = torch.full((x.shape[0],), sigma, dtype=torch.float32, device=x.device)
    return denoise(x.float(), sig).to(torch.float64)


def flow_times(steps: int) -> list[float]:
    """The flow ODE's grid: `steps` uniform steps of t from 1 (pure noise) to 0 (the sample), float64."""
    return [1.0 - k / steps for k in range(steps)] + [0.0]


def sample_flow(velocity: Callable, noise: torch.Tensor, times: list[float], sampler: str) -> torch.Tensor:
    """The samples [B, *shape] of dx/dt = v(x, t) integrated from x(1) = `noise` (the keyed ε) to t = 0.

    sampler: heun | euler. Heun's correction is skipped on the last step, as EDM's is: the model is never
    evaluated at t = 0, outside the levels flow training draws (0, 1)."""
    x = noise.to(torch.float64)
    for t_cur, t_next in itertools.pairwise(times):
        v = _denoised(velocity, x, t_cur)
        x_next = x + (t_next - t_cur) * v
        if sampler == "heun" and t_next > 0:
            x_next = x + (t_next - t_cur) * 0.5 * (v + _denoised(velocity, x_next, t_next))
        x = x_next
    return x.float()


def vp_timesteps(steps: int, n_timesteps: int) -> list[float]:
    """DDIM's grid for a model of `n_timesteps` training timesteps: `steps` timesteps from T − 1 down,
    evenly spaced ("trailing", Lin et al. 2024: the first step starts at the last training timestep), then
    the clean end, written 0 as every grid ends (ᾱ = 1 there: the sampler never feeds it to the model)."""
    out = [float(round(n_timesteps * (1 - k / steps)) - 1) for k in range(steps)]
    return [*out, 0.0]


def ddim_step(x: torch.Tensor, eps: torch.Tensor, abar: float, abar_next: float, eta: float = 0.0,
              z: torch.Tensor | None = None) -> torch.Tensor:
    """One DDIM step (Song et al. 2021, eq. 12) from x_t with ᾱ_t = abar to ᾱ_next, given the predicted
    noise `eps`: x̂_0 = (x_t − √(1−ᾱ_t)·ε̂)/√ᾱ_t, then √ᾱ_next·x̂_0 + √(1 − ᾱ_next − s²)·ε̂ + s·z with
    s = η·√((1 − ᾱ_next)/(1 − ᾱ_t))·√(1 − ᾱ_t/ᾱ_next) (0 at η = 0, and at the clean end ᾱ_next = 1)."""
    x0 = (x - math.sqrt(1 - abar) * eps) / math.sqrt(abar)
    noisy = eta > 0 and abar < abar_next < 1  # a step that adds no noise is exactly the deterministic one
    s = eta * math.sqrt((1 - abar_next) / (1 - abar)) * math.sqrt(1 - abar / abar_next) if noisy else 0.0
    out = math.sqrt(abar_next) * x0 + math.sqrt(max(1 - abar_next - s * s, 0.0)) * eps
    return out + s * z if s > 0 else out


def noised_steps(objective: str, grid: list[float], churn: dict) -> list[int]:
    """The steps k at which the objective's sampler adds keyed noise (step_noise(…, k, …)): EDM's churned
    steps; under vp with η > 0 every step but the last (it lands on the clean end, where DDIM adds none)."""
    steps = len(grid) - 1
    if objective == "vp":
        return list(range(steps - 1)) if churn.get("eta", 0.0) > 0 else []
    if objective == "flow":
        return []
    return [k for k, s in enumerate(grid[:-1])
            if gamma_of(s, steps, churn["s_churn"], churn["s_tmin"], churn["s_tmax"]) > 0]


def sample_vp(eps_model: Callable, noise: torch.Tensor, timesteps: list[float], abar: torch.Tensor,
              sampler: str, eta: float = 0.0, noise_at: Callable[[int], torch.Tensor] | None = None
              ) -> torch.Tensor:
    """The samples [B, *shape] DDIM reaches from x_T = `noise` (the keyed ε) over `timesteps` (the grid:
    its last entry is the clean end, ᾱ = 1); `abar` the model's ᾱ over its timesteps.

    euler: DDIM (η = `eta`; noise_at(k) the batch's keyed noise at step k, drawn only when η > 0).
    heun: the deterministic DDIM step with Heun's correction: DDIM is Euler's method on the probability-
    flow ODE written in y = x/√ᾱ and s = √(1−ᾱ)/√ᾱ (dy/ds = ε̂), so the corrector averages ε̂ at both ends
    of the step; skipped on the last step, as EDM's is (the model is never fed the clean end)."""
    abars = [float(v) for v in abar.double()[[int(t) for t in timesteps[:-1]]]] + [1.0]
    x = noise.to(torch.float64)
    for k, (t_cur, a_cur, a_next) in enumerate(zip(timesteps[:-1], abars[:-1], abars[1:], strict=True)):
        eps = _denoised(eps_model, x, t_cur)
        z = noise_at(k).to(x.device, torch.float64) if eta > 0 and a_next < 1 else None
        x_next = ddim_step(x, eps, a_cur, a_next, eta, z)
        if sampler == "heun" and a_next < 1:
            eps_next = _denoised(eps_model, x_next, timesteps[k + 1])
            x_next = ddim_step(x, 0.5 * (eps + eps_next), a_cur, a_next)
        x = x_next
    return x.float()


SAMPLERS = ("heun", "euler")  # sample.sampler: each integrates whichever objective's ODE the run has
ODES = ("edm", "flow", "vp")  # the objectives (by name) a sampler exists for


def levels(objective: str, steps: int, sigma_min: float, sigma_max: float, rho: float,
           n_timesteps: int | None = None) -> list[float]:
    """The objective's grid of levels a sampler visits, ending at 0 (vp: the model's `n_timesteps`)."""
    if objective == "vp":
        return vp_timesteps(steps, n_timesteps)
    return flow_times(steps) if objective == "flow" else edm_sigmas(steps, sigma_min, sigma_max, rho)


def integrate(objective: str, model: Callable, noise: torch.Tensor, grid: list[float], sampler: str,
              churn: dict, noise_at: Callable[[int], torch.Tensor] | None = None,
              abar: torch.Tensor | None = None) -> torch.Tensor:
    """The objective's sampler: `model(x, level)` is D(x; σ) under edm, v(x, t) under flow, ε(x_t, t)
    under vp (whose ᾱ is `abar`, the model's schedule)."""
    if objective == "flow":
        return sample_flow(model, noise, grid, sampler)
    if objective == "vp":
        return sample_vp(model, noise, grid, abar, sampler, churn.get("eta", 0.0), noise_at)
    return sample(model, noise, grid, sampler, churn, noise_at)
