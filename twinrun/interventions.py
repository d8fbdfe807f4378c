"""Interventions: what an arm changes. The native twin changes nothing.

An intervention is a small object (built from config by one level of Hydra `_target_`) with
  name                 the arm's name in the run directory,
  sigma_cond(sigma)    the σ fed to the denoiser's conditioning pathway at noising σ,
  gate_sigmas(grid)    the bins where it is a no-op: there it must match its twin (the gate),
  check(grid)          raise ConfigError if it cannot run on this grid.
"""

import math

import torch

from twinrun.errors import ConfigError


class Native:
    """The twin: σ_cond = σ."""

    name = "native"

    def sigma_cond(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma

    def gate_sigmas(self, grid: list[float]) -> list[float]:
        return list(grid)

    def check(self, grid: list[float]) -> None:
        pass


class PinSigma:
    """Pin σ_cond at sigma_pin in every bin; a no-op in the bin σ = sigma_pin."""

    name = "pin_sigma"

    def __init__(self, sigma_pin: float):
        self.sigma_pin = float(sigma_pin)

    def sigma_cond(self, sigma: torch.Tensor) -> torch.Tensor:
        # Same dtype and device as σ so that at the gate bin both arms feed bit-identical inputs.
        return torch.full_like(sigma, self.sigma_pin)

    def gate_sigmas(self, grid: list[float]) -> list[float]:
        return [s for s in grid if s == self.sigma_pin]

    def check(self, grid: list[float]) -> None:
        if not (math.isfinite(self.sigma_pin) and self.sigma_pin > 0):
            raise ConfigError("intervention.sigma_pin", self.sigma_pin, "must be a positive σ")
        if self.sigma_pin not in grid:
            raise ConfigError(
                "intervention.sigma_pin",
                self.sigma_pin,
                f"must be a bin of sigma_grid.sigmas={grid} (that bin is its no-op gate); "
                "pick one of them or add it to the grid",
            )


class ScaleCond:
    """Scale the conditioning signal c_noise = ln(σ)/4 about an anchor σ_a:
    ln σ_cond = ln σ_a + gamma·(ln σ − ln σ_a). gamma = 1 is native, gamma = 0 is pin_sigma at σ_a;
    in between it flattens how strongly the network is told the noise level. A no-op in the bin
    σ = σ_a: that bin is its gate."""

    name = "scale_cond"

    def __init__(self, anchor_sigma: float, gamma: float):
        self.anchor_sigma, self.gamma = float(anchor_sigma), float(gamma)

    def sigma_cond(self, sigma: torch.Tensor) -> torch.Tensor:
        if self.gamma == 1:  # native exactly (exp∘log does not round-trip): refused as a no-op everywhere
            return sigma
        log_a = math.log(self.anchor_sigma)
        scaled = torch.exp(log_a + self.gamma * (torch.log(sigma) - log_a))
        # exp(log(σ_a)) need not round back to σ_a: feed σ itself at the anchor, so the gate bin
        # is bit-identical to the twin.
        return torch.where(sigma == self.anchor_sigma, sigma, scaled)

    def gate_sigmas(self, grid: list[float]) -> list[float]:
        return [s for s in grid if s == self.anchor_sigma]

    def check(self, grid: list[float]) -> None:
        if not (math.isfinite(self.anchor_sigma) and self.anchor_sigma > 0):
            raise ConfigError("intervention.anchor_sigma", self.anchor_sigma, "must be a positive σ")
        if not math.isfinite(self.gamma):
            raise ConfigError("intervention.gamma", self.gamma, "must be a finite number (1 = native)")
        if self.anchor_sigma not in grid:
            raise ConfigError("intervention.anchor_sigma", self.anchor_sigma,
                              f"must be a bin of sigma_grid.sigmas={grid} (that bin is its no-op gate)")
