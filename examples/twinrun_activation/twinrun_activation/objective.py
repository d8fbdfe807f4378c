"""An objective of your own: EDM with min-SNR-γ weighting (Hang et al. 2023), found by entry point.

Selected by name like a built-in (`objective=edm_minsnr objective.gamma=5`): twinrun registers its
schema from the class, so its fields are its config keys. Only the per-sample weight differs from
`edm`: λ(σ)·min(SNR(σ), γ)/SNR(σ), with SNR(σ) = σ_data²/σ², so low-noise samples stop dominating."""

from dataclasses import dataclass
from typing import ClassVar

import torch

from twinrun.objectives import EDM


@dataclass
class MinSNR(EDM):
    gamma: float = 5.0  # the SNR at which the weight stops growing
    name: ClassVar[str] = "edm_minsnr"

    def weight(self, model, level: torch.Tensor) -> torch.Tensor:
        snr = model.sigma_data ** 2 / level ** 2
        return super().weight(model, level) * torch.clamp(self.gamma / snr, max=1.0)
