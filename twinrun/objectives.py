"""Diffusion objectives: how a clean sample is noised, what the network predicts, how a sample's loss is
weighted, in one small class per objective (config group `objective`; docs/objectives.md).

A *level* is the objective's own noise coordinate: σ for `edm`, t ∈ (0, 1) for `flow`, the model's
timestep for `vp`. The probe's grid (`sigma_grid.sigmas`), a pinned or scaled conditioning value
(`pin_sigma`, `scale_cond`) and the level a training step draws are all levels. The model's forward is
always

    forward(x_t, level, level_cond, **cond) -> the objective's prediction

with `level` and `level_cond` tensors [B] (the level that noised x_t, and the one fed to the
conditioning pathway: an intervention may change the latter alone) and `cond` the per-image
conditioning, each entry sliced and repeated exactly as the images. The prediction is the denoised
sample (edm), the velocity ε − x (flow) or the noise ε (vp): whatever `target` returns.

An objective defines, once, for the probe (every method) and for training alike:

  noisy(model, x, eps, level)    x_t, the network's noisy input      (x, eps [B, ...]; level [B])
  target(model, x, eps, level)   what the network's output is compared to
  weight(model, level)           λ(level), the per-sample loss weight, the same shape as `level`
  train_level(model, normal)     a training step's levels from standard normal draws [B] (one per sample)
  check(key, levels, model)      ConfigError for levels it cannot take (grid values, a pin); `model`
                                 None before one is built (checks needing the model's schedule wait)
  check_model(model)             ConfigError when the model lacks what the objective reads from it

and a sample's loss is λ(level) · mean over elements of (prediction − target)². The weight depends on
the level alone, so the probe, whose bin has one level, factors it out of the bin's sums; training
applies it per sample. `edm` is exactly the arithmetic twinrun always ran (bit-identical stores).

Your own objective: a dataclass subclass of `Objective` (its fields are its config keys), selected by
`objective._target_: your.module.YourObjective` (built by `twinrun.instantiate.objective_of`: this module
imports torch alone). `OBJECTIVES` maps the built-in names to their classes;
a lookup may extend it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from twinrun.errors import ConfigError

# Log-normal training σ distribution (Karras et al. 2022, Table 1: P_mean, P_std).
EDM_P_MEAN = -1.2
EDM_P_STD = 1.2


def edm_weight(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    # λ(σ) = (σ² + σ_data²) / (σ·σ_data)²  (EDM, Karras et al. 2022, Table 1).
    return (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2


def _bcast(level: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-sample level [B] as [B, 1, ..., 1] against samples x [B, ...]."""
    return level.reshape(-1, *([1] * (x.dim() - 1)))


def _finite(key: str, levels: list[float]) -> None:
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in levels):
        raise ConfigError(key, levels, "every level must be a finite number")


@dataclass
class Objective:
    """The interface (module docstring); subclasses implement every method."""

    name: ClassVar[str] = "objective"
    unit: ClassVar[str] = "level"  # what a level is, in words (reports, errors)
    prediction: ClassVar[str] = "prediction"  # what the model's forward returns, in words

    def noisy(self, model, x: torch.Tensor, eps: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def target(self, model, x: torch.Tensor, eps: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight(self, model, level: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(level)

    def train_level(self, model, normal: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def check(self, key: str, levels: list[float], model=None) -> None:
        _finite(key, levels)

    def check_model(self, model) -> None:
        pass

    def per_sample_loss(self, model, output: torch.Tensor, x: torch.Tensor, eps: torch.Tensor,
                        level: torch.Tensor) -> torch.Tensor:
        """[B]: λ(level)·mean over elements of (output − target)², one term per sample (training's form)."""
        weight = _bcast(self.weight(model, level), x)
        return (weight * (output - self.target(model, x, eps, level)) ** 2).flatten(1).mean(1)


@dataclass
class EDM(Objective):
    """x_t = x + σ·ε; the network returns the denoised x; λ(σ) = (σ² + σ_d²)/(σ·σ_d)² with the model's
    `sigma_data`; training draws ln σ ~ N(p_mean, p_std²) (Karras et al. 2022)."""

    p_mean: float = EDM_P_MEAN  # training: ln σ's mean
    p_std: float = EDM_P_STD  # training: ln σ's standard deviation
    name: ClassVar[str] = "edm"
    unit: ClassVar[str] = "σ"
    prediction: ClassVar[str] = "the denoised sample"

    def noisy(self, model, x, eps, level):
        return x + _bcast(level, x) * eps

    def target(self, model, x, eps, level):
        return x

    def weight(self, model, level):
        return edm_weight(level, model.sigma_data)

    def train_level(self, model, normal):
        return torch.exp(self.p_mean + self.p_std * normal)

    def check(self, key, levels, model=None):
        _finite(key, levels)
        if not all(v > 0 for v in levels):
            raise ConfigError(key, levels, "every σ must be positive (objective=edm)")

    def check_model(self, model):
        sd = getattr(model, "sigma_data", None)
        try:
            ok = math.isfinite(float(sd)) and float(sd) > 0
        except (TypeError, ValueError, RuntimeError):  # absent, or not one number
            ok = False
        if not ok:
            raise ConfigError("objective", self.name, f"the model's sigma_data is {sd!r}; objective=edm "
                              "weighs each σ by it: give the model a positive float attribute `sigma_data`")


@dataclass
class Flow(Objective):
    """Rectified flow as SD3 and Flux train it: x_t = (1 − t)·x + t·ε, the network returns the velocity
    ε − x, weight 1; training draws t = sigmoid(logit_mean + logit_std·n) (logit-normal)."""

    logit_mean: float = 0.0
    logit_std: float = 1.0
    name: ClassVar[str] = "flow"
    unit: ClassVar[str] = "t"
    prediction: ClassVar[str] = "the velocity ε − x"

    def noisy(self, model, x, eps, level):
        t = _bcast(level, x)
        return (1 - t) * x + t * eps

    def target(self, model, x, eps, level):
        return eps - x

    def train_level(self, model, normal):
        return torch.sigmoid(self.logit_mean + self.logit_std * normal)

    def check(self, key, levels, model=None):
        _finite(key, levels)
        if not all(0 < v < 1 for v in levels):
            raise ConfigError(key, levels, "every t must lie in (0, 1) (objective=flow: 0 is the clean "
                              "sample, 1 pure noise); e.g. sigma_grid=flow6")


@dataclass
class VP(Objective):
    """DDPM ε-prediction: x_t = √ᾱ_t·x + √(1 − ᾱ_t)·ε with ᾱ the model's declared schedule
    (`model.alphas_cumprod`, a 1-d tensor over its T timesteps, as diffusers' schedulers hold it); a
    level is a timestep t ∈ {0, …, T − 1}; the network returns ε; weight 1; training draws t uniformly
    (t = ⌊Φ(n)·T⌋, Φ the normal CDF)."""

    name: ClassVar[str] = "vp"
    unit: ClassVar[str] = "timestep"
    prediction: ClassVar[str] = "the noise ε"

    @staticmethod
    def schedule(model) -> torch.Tensor:
        return model.alphas_cumprod

    def coefficients(self, model, level: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(√ᾱ_t, √(1 − ᾱ_t)) [B, 1, ..., 1] in x's dtype, computed in float64 from the schedule."""
        abar = self.schedule(model).to(x.device, torch.float64)[level.long()]
        return _bcast(abar.sqrt().to(x.dtype), x), _bcast((1 - abar).sqrt().to(x.dtype), x)

    def noisy(self, model, x, eps, level):
        a, b = self.coefficients(model, level, x)
        return a * x + b * eps

    def target(self, model, x, eps, level):
        return eps

    def train_level(self, model, normal):
        n_steps = len(self.schedule(model))
        u = torch.special.ndtr(normal.double())
        return (u * n_steps).floor().clamp(0, n_steps - 1).to(normal.dtype)

    def check(self, key, levels, model=None):
        _finite(key, levels)
        if not all(float(v).is_integer() and v >= 0 for v in levels):
            raise ConfigError(key, levels, "every level must be a timestep, an integer ≥ 0 (objective=vp); "
                              "e.g. sigma_grid=vp6 intervention.sigma_pin=500")
        if model is not None:
            n_steps = len(self.schedule(model))
            if any(v >= n_steps for v in levels):
                raise ConfigError(key, levels, f"the model's schedule has {n_steps} timesteps: use 0 … "
                                  f"{n_steps - 1} (objective=vp)")

    def check_model(self, model):
        abar = getattr(model, "alphas_cumprod", None)
        ok = isinstance(abar, torch.Tensor) and abar.dim() == 1 and len(abar) > 0
        if not ok or not bool(((abar > 0) & (abar <= 1)).all()):
            raise ConfigError("objective", self.name, "objective=vp reads ᾱ from the model: give it "
                              "`alphas_cumprod`, a 1-d tensor over its timesteps with values in (0, 1] "
                              "(e.g. diffusers' DDPMScheduler(...).alphas_cumprod)")


# The built-in objectives by name (conf/objective/<name>.yaml selects each); a lookup may extend it.
OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (EDM, Flow, VP)}


def target(cls: type) -> str:
    """The `_target_` that builds the class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def schema(cls: type[Objective]) -> type:
    """The class's config schema (schema/objective/<name>): its own fields, its `_target_` first."""
    own = [(f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(f"{cls.__name__}Config", [("_target_", str, target(cls)), *own])
