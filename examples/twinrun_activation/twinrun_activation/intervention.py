"""An intervention of your own: multiply the σ fed to the conditioning pathway by `factor`.

Selected by name like a built-in (`intervention=scale_sigma_cond`): twinrun registers its schema from
the class, so its fields are its config keys. factor = 1 is its no-op setting (σ·1.0 is σ exactly), run
as the machinery arm, which must be bit-identical to the twin."""

from dataclasses import dataclass
from typing import ClassVar

import torch

from twinrun.errors import ConfigError
from twinrun.interventions import Intervention


@dataclass
class ScaleSigmaCond(Intervention):
    factor: float = 1.1  # σ_cond = factor·σ; 1 is the twin
    name: ClassVar[str] = "scale_sigma_cond"
    sweep_axis: ClassVar[str] = "factor"

    def sigma_cond(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma * self.factor

    def noop(self) -> dict:
        return {"factor": 1.0}

    def check(self, grid: list[float]) -> None:
        if not self.factor > 0:
            raise ConfigError("intervention.factor", self.factor, "must be a positive factor (1 = the twin)")

    def check_train(self) -> None:
        self.check([])
