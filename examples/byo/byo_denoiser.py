"""A researcher's own denoiser, brought to twinrun without changing twinrun.

The interface twinrun needs from a model (see README "Bring your own model"):
  forward(x [B, C, H, W], sigma [B], sigma_cond [B]) -> denoised x, same shape
  sigma_data: float                      the data std, for the EDM loss weight
  COND_PARAM_PATTERNS: tuple[str, ...]   fnmatch names of the conditioning pathway (optional)
and it must run under torch.func (functional_call + vmap + grad): no in-place ops on
parameters, no .item(), no data-dependent Python branches.
"""

import math

import torch
from torch import nn


class TinyFilmDenoiser(nn.Module):
    """Two 3x3 conv layers with FiLM from a σ_cond embedding; EDM-style skip scaling from σ."""

    COND_PARAM_PATTERNS = ("film.*",)

    def __init__(self, channels: int = 1, width: int = 16, sigma_data: float = 0.5):
        super().__init__()
        self.sigma_data = sigma_data
        self.conv_in = nn.Conv2d(channels, width, 3, padding=1)
        self.conv_out = nn.Conv2d(width, channels, 3, padding=1)
        self.film = nn.Sequential(nn.Linear(1, width), nn.SiLU(), nn.Linear(width, 2 * width))

    def forward(self, x, sigma, sigma_cond=None):
        sigma_cond = sigma if sigma_cond is None else sigma_cond
        s = sigma.reshape(-1, 1, 1, 1)
        c_skip = self.sigma_data**2 / (s**2 + self.sigma_data**2)
        c_in = 1 / torch.sqrt(s**2 + self.sigma_data**2)
        scale, shift = self.film(torch.log(sigma_cond).reshape(-1, 1) / 4).chunk(2, dim=1)
        h = torch.nn.functional.silu(self.conv_in(c_in * x))
        h = h * (1 + scale[:, :, None, None]) + shift[:, :, None, None]
        return c_skip * x + self.conv_out(h)


def build(width: int = 16, seed: int = 0, sigma_data: float = 0.5) -> TinyFilmDenoiser:
    """The config's `_target_`: a seeded model (untrained is fine for a probe of the pipeline)."""
    torch.manual_seed(seed)
    model = TinyFilmDenoiser(width=width, sigma_data=sigma_data)
    for p in model.parameters():  # a little away from the default init so every path carries signal
        p.data.add_(0.05 * torch.randn_like(p) * math.sqrt(1 / max(1, p.shape[-1])))
    return model.eval()
