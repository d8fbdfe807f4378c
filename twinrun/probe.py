"""The probe: per-fold sums of per-sample gradients of the EDM loss, one bin and arm at a time.

Per-image gradients come from torch.func (grad of the image's loss summed over its draws,
vmapped over a chunk of images), so one call costs about one batched backward, not one backward
per sample; they are added into their image's fold at once, so memory is bounded by the chunk,
not by n_images x n_draws.
"""

import fnmatch
import sys

import torch
from torch.func import functional_call, grad, vmap

from twinrun.errors import EXIT_GATE, ConfigError, TwinrunError


class NonFiniteGradient(TwinrunError):
    """The measurement itself failed: the instrument is broken at this bin (exit 1)."""

    exit_code = EXIT_GATE


def select_params(model: torch.nn.Module, patterns: list[str]) -> list[str]:
    """Names of the parameters matching any fnmatch pattern, in the model's own order."""
    names = [n for n, _ in model.named_parameters() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not names:
        raise ConfigError("probe.params", list(patterns), "matches no parameter of the model; "
                          f"names look like {[n for n, _ in model.named_parameters()][:4]}")
    return names


def layout(model: torch.nn.Module, names: list[str], cond_patterns: list[str]) -> list[dict]:
    """Where each probed parameter lives in a store's columns, and whether it is conditioning."""
    params = dict(model.named_parameters())
    out, offset = [], 0
    for n in names:
        numel = params[n].numel()
        cond = any(fnmatch.fnmatchcase(n, p) for p in cond_patterns)
        out.append({"name": n, "offset": offset, "numel": numel, "shape": list(params[n].shape), "cond": cond})
        offset += numel
    return out


def cond_patterns(model: torch.nn.Module) -> list[str]:
    """The model's own names for its conditioning pathway: `COND_PARAM_PATTERNS` on the model
    (or its class, or its module); none means the `cond` estimand is unavailable."""
    found = getattr(model, "COND_PARAM_PATTERNS", None)
    if found is None:
        found = getattr(sys.modules.get(type(model).__module__), "COND_PARAM_PATTERNS", ())
    return list(found)


def edm_weight(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    # λ(σ) = (σ² + σ_data²) / (σ·σ_data)²  (EDM, Karras et al. 2022, Table 1).
    return (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2


def fold_sums(
    model: torch.nn.Module,
    names: list[str],
    images: torch.Tensor,  # [N, C, H, W] on the device
    eps: torch.Tensor,  # [N, D, C, H, W] on the device
    sigma: float,
    sigma_cond: torch.Tensor,  # 0-d tensor, the σ fed to the conditioning pathway
    fold_of_image: torch.Tensor,  # [N] int64 on the device
    n_folds: int,
    chunk_images: int = -1,
) -> torch.Tensor:
    """[n_folds, P] float32: Σ over the fold's images and draws of ∇ loss(image, draw)."""
    params = dict(model.named_parameters())
    probed = {n: params[n].detach() for n in names}
    frozen = {n: p.detach() for n, p in params.items() if n not in probed}
    frozen.update(dict(model.named_buffers()))
    n_draws = eps.shape[1]
    sig = torch.full((n_draws,), float(sigma), dtype=images.dtype, device=images.device)
    sig_cond = sigma_cond.to(images.dtype).expand(n_draws)
    weight = edm_weight(sig, float(model.sigma_data))

    def image_loss(p, x, e):  # x [C,H,W], e [D,C,H,W]: the image's loss summed over its draws
        denoised = functional_call(model, (p, frozen), (x + sig.view(-1, 1, 1, 1) * e, sig, sig_cond))
        per_sample = (denoised - x).square().flatten(1).mean(1)
        return (weight * per_sample).sum()

    per_image_grad = vmap(grad(image_loss), in_dims=(None, 0, 0))
    n_params = sum(p.numel() for p in probed.values())
    sums = torch.zeros(n_folds, n_params, dtype=torch.float64, device=images.device)
    chunk = images.shape[0] if chunk_images < 1 else chunk_images
    for start in range(0, images.shape[0], chunk):
        g = per_image_grad(probed, images[start : start + chunk], eps[start : start + chunk])
        flat = torch.cat([g[n].flatten(1) for n in names], dim=1)
        sums.index_add_(0, fold_of_image[start : start + chunk], flat.double())
    return sums.float()


def check_finite(sums: torch.Tensor, arm: str, bin_index: int, sigma: float) -> None:
    if not torch.isfinite(sums).all():
        bad = (~torch.isfinite(sums)).sum().item()
        raise NonFiniteGradient(
            f"arm {arm}, bin {bin_index} (σ={sigma:g}): {bad} gradient entries are NaN or inf; "
            "earlier bins are kept. Check the model at this σ (or the probed parameters)"
        )
