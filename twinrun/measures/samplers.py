"""The samplers twin sampling runs (measure=sample), one ODE per objective: under `edm`, EDM's
deterministic Heun and Euler samplers and their stochastic variant (Karras et al. 2022, Algorithms 1
and 2); under `flow`, the rectified-flow ODE dx/dt = v(x, t) from t = 1 to 0 (Euler or Heun), all on
keyed noise.

Every random number a sample consumes is a pure function of (seed, sample index[, step]) — its initial
noise and, with s_churn > 0, its noise at each step — drawn on the CPU (twinrun/draws.py) and only then
moved to the device. So every arm, any chunking and a resume see the same noise for the same sample,
and the arms differ only by what the intervention does to the denoiser.

A sampler here takes the arm's model as a function of (x, level) — with its level_cond, hooks and each
sample's conditioning bound by the caller — and the objective's grid of levels (`levels`): D(x; σ)
on EDM's σ schedule, the velocity v(x, t) on a uniform t grid for flow. ODES names the objectives a
sampler exists for; another objective (vp) is refused before any compute.
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


SAMPLERS = ("heun", "euler")  # sample.sampler: each integrates whichever objective's ODE the run has
ODES = ("edm", "flow")  # the objectives (by name) a sampler exists for


def levels(objective: str, steps: int, sigma_min: float, sigma_max: float, rho: float) -> list[float]:
    """The objective's grid of levels a sampler visits, ending at 0."""
    return flow_times(steps) if objective == "flow" else edm_sigmas(steps, sigma_min, sigma_max, rho)


def integrate(objective: str, model: Callable, noise: torch.Tensor, grid: list[float], sampler: str,
              churn: dict, noise_at: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
    """The objective's sampler: `model(x, level)` is D(x; σ) under edm, v(x, t) under flow."""
    if objective == "flow":
        return sample_flow(model, noise, grid, sampler)
    return sample(model, noise, grid, sampler, churn, noise_at)
