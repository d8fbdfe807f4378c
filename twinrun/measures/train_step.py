"""One arm's training arithmetic: the objective's loss, one optimizer step, the held-out loss, the weights'
digests.

The loss is the run's objective's (twinrun/objectives.py; edm, the default, is the one
`python -m twinrun.train` trained the committed model with: Karras et al. 2022, Eq. 2 with Table 1's
λ(σ) and log-normal p(σ)), written per sample so that a batch cut into chunks
sums the same terms. An arm's intervention acts where it declares (twinrun/interventions.py): the
σ fed to the conditioning pathway, forward hooks, a per-sample loss weight; its learning rate is
set once, when its optimizer is built.
"""

import hashlib

import torch

from twinrun import conditioning
from twinrun.errors import EXIT_GATE, TwinrunError
from twinrun.interventions import Intervention, attached
from twinrun.objectives import EDM, EDM_P_MEAN, EDM_P_STD, Objective

# Log-normal training σ distribution (Karras et al. 2022, Table 1: P_mean, P_std): objective=edm's.
P_MEAN = EDM_P_MEAN
P_STD = EDM_P_STD
DIGEST_HEX = 16  # hex digits kept of each weight's per-step sha256 (64 bits: no collision in practice)


class NonFiniteLoss(TwinrunError):
    """The training itself failed (a NaN or inf loss or weight): the run stops there (exit 1)."""

    exit_code = EXIT_GATE


def sigma_of(normal: torch.Tensor) -> torch.Tensor:
    """σ = exp(P_mean + P_std·n): the log-normal training noise level of each sample's normal draw."""
    return torch.exp(P_MEAN + P_STD * normal)


def per_sample_loss(model: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, eps: torch.Tensor,
                    sigma_cond: torch.Tensor, objective: Objective | None = None,
                    cond: dict | None = None) -> torch.Tensor:
    """[B]: λ(σ)·mean over pixels of (F(x_σ; σ, σ_cond, **cond) − target)², one term per sample, in the
    objective's terms (edm, the default: F denoises x + σε, the target is x); cond: each sample's rows."""
    objective = EDM() if objective is None else objective
    out = model(objective.noisy(model, x, eps, sigma), sigma, sigma_cond, **(cond or {}))
    return objective.per_sample_loss(model, out, x, eps, sigma)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, intervention: Intervention,
               x: torch.Tensor, sigma: torch.Tensor, eps: torch.Tensor, chunk: int,
               objective: Objective | None = None, cond: dict | None = None) -> torch.Tensor:
    """One optimizer step on the batch (x, σ, ε, and each sample's conditioning rows), forward and backward
    in chunks of ≤ `chunk` samples; the loss is the batch mean of the per-sample losses. Returns it (0-d,
    detached, on the device)."""
    batch = x.shape[0]
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=x.device)
    for lo in range(0, batch, chunk):
        part = slice(lo, lo + chunk)
        losses = per_sample_loss(model, x[part], sigma[part], eps[part], intervention.sigma_cond(sigma[part]),
                                 objective, conditioning.take(cond or {}, part))
        weight = intervention.loss_weight(sigma[part], getattr(model, "sigma_data", 1.0))
        if weight is not None:
            losses = losses * weight
        loss = losses.sum() / batch
        loss.backward()
        total += loss.detach()
    optimizer.step()
    return total


@torch.no_grad()
def heldout_losses(model: torch.nn.Module, intervention: Intervention, images: torch.Tensor,
                   normal: torch.Tensor, eps: torch.Tensor, chunk: int, objective: Objective | None = None,
                   cond: dict | None = None) -> torch.Tensor:
    """[N] float32 on the CPU: each held-out image's loss under the arm's model as it trains (its
    hooks and σ_cond; no loss weight, which changes the objective, not the model), on fixed draws."""
    model.eval()
    objective = EDM() if objective is None else objective
    sigma = objective.train_level(model, normal)
    out = []
    with attached(intervention, model):
        for lo in range(0, images.shape[0], chunk):
            part = slice(lo, lo + chunk)
            out.append(per_sample_loss(model, images[part], sigma[part], eps[part],
                                       intervention.sigma_cond(sigma[part]), objective,
                                       conditioning.take(cond or {}, part)))
    model.train()
    return torch.cat(out).float().cpu()


def weight_digests(model: torch.nn.Module) -> list[str]:
    """A sha256 prefix of every parameter's bytes, in named_parameters() order: which tensors two arms
    share bit for bit after a step, and so the first step at which an arm leaves the twin."""
    return [hashlib.sha256(_host(p)).hexdigest()[:DIGEST_HEX] for p in model.parameters()]


def _host(p: torch.Tensor):
    """A parameter's bytes on the host: its own memory on the CPU (no copy), a copy from a GPU."""
    t = p.detach() if p.device.type == "cpu" else p.detach().cpu()
    if t.dtype == torch.bfloat16 or not t.is_contiguous():  # numpy has no bfloat16: its bytes instead
        t = t.contiguous().reshape(-1).view(torch.uint8)
    return t.numpy()
