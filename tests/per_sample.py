"""The reference every probe test measures against: one forward and backward per (image, draw),
written independently of twinrun.measures.fold_sums."""

import torch


def loop_sums(model, names, images, eps, sigma, sigma_cond, folds):
    """One forward and backward per (image, draw); gradients summed into the image's fold."""
    sd = model.sigma_data
    lam = (sigma**2 + sd**2) / (sigma * sd) ** 2  # EDM loss weight
    params = dict(model.named_parameters())
    out = torch.zeros(max(folds) + 1, sum(params[n].numel() for n in names), dtype=torch.float64)
    for i, fold in enumerate(folds):
        for d in range(eps.shape[1]):
            model.zero_grad(set_to_none=True)
            x = images[i : i + 1]
            denoised = model(x + sigma * eps[i, d : d + 1], torch.tensor([sigma]), torch.tensor([sigma_cond]))
            loss = lam * ((denoised - x) ** 2).mean()
            loss.backward()
            out[fold] += torch.cat([params[n].grad.flatten() for n in names]).double()
    model.zero_grad(set_to_none=True)
    return out.float()
