"""Interventions: what an arm changes. The native twin changes nothing.

An intervention is one class and one YAML file: the class is a dataclass whose fields are its config
keys (its own schema: `register_schemas` puts every class of INTERVENTIONS into Hydra's ConfigStore,
so a typo'd key or a wrong type fails in Hydra), built from config by one level of Hydra `_target_`.
It may act at these places, each optional (the base class's defaults do nothing):
  sigma_cond(sigma)    the σ fed to the denoiser's conditioning pathway at noising σ,
  attach(model)        forward hooks by module name: a module's output, the model's inputs,
                       returning the handles that remove them after the arm's measurement,
and, in a training run (measure=train), also at
  train_lr(lr)         the learning rate its arm trains with,
  loss_weight(sigma, sigma_data)   a per-sample weight on the training loss (None: none),
  train_settings(train)   the arm's training settings (its `train` node) as it trains (override),
and it declares how it can be checked against its twin:
  gate_sigmas(grid)    the bins where it is a no-op: there it must be bit-identical to its twin,
  noop()               its no-op setting (overrides of its own config keys), or None: twinrun runs
                       the intervention's own code at that setting as the *machinery arm*, which must
                       be bit-identical to the twin in every bin,
  level_noop()         a no-op setting at every level, where noop() is None because its gate is a
                       level (a bin of the grid): a kind whose units visit levels no grid fixes (a
                       sampler's steps) has no such gate and runs this setting as its machinery arm,
  sweep_axis           the config key a sweep over this intervention varies,
  check(grid), check_model(model), check_train()   raise ConfigError for settings it cannot run with
                       (check_train: in a training run, which has no σ grid).
An intervention with neither a gate bin nor a no-op setting proves nothing and is refused.
"""

import copy
import difflib
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig, OmegaConf

from twinrun.errors import ConfigError


@dataclass
class Intervention:
    """Defaults: the twin's behaviour everywhere, no gate bin, no no-op setting."""

    name: ClassVar[str] = "intervention"  # its arm directory
    sweep_axis: ClassVar[str | None] = None  # the config key a sweep over it varies

    def sigma_cond(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma

    def attach(self, model: torch.nn.Module) -> list:
        return []

    def gate_sigmas(self, grid: list[float]) -> list[float]:
        return []

    def noop(self) -> dict | None:
        return None

    def level_noop(self) -> dict | None:
        return None

    def check(self, grid: list[float]) -> None:
        pass

    def check_model(self, model: torch.nn.Module) -> None:
        pass

    def train_lr(self, lr: float) -> float:
        return lr

    def loss_weight(self, sigma: torch.Tensor, sigma_data: float) -> torch.Tensor | None:
        return None

    def check_train(self) -> None:
        pass

    def train_settings(self, train: dict) -> dict:
        return train


@dataclass
class Native(Intervention):
    """The twin: σ_cond = σ, no hooks."""

    name: ClassVar[str] = "native"

    def gate_sigmas(self, grid: list[float]) -> list[float]:
        return list(grid)


FOLLOW = 0.0  # a level setting following each call's own level (a pin or anchor of 0 is refused by check())


def acts_through(intervention, hooks) -> list[str]:
    """The hooks among `hooks` an intervention's class overrides: where in a kind it can act at all."""
    return [h for h in hooks if getattr(type(intervention), h) is not getattr(Intervention, h)]


def one_level(sigma: torch.Tensor, who: str) -> float:
    """The one level a call is fed, for a setting at FOLLOW (a sampler step and a probe bin feed one level
    to the whole batch; a float32 σ read as a Python float and filled back as float32 is the same number).
    A training batch feeds several: such a setting has no no-op there, and says so."""
    level = float(sigma.reshape(-1)[0])
    if not bool((sigma == level).all()):
        raise ValueError(f"{who} needs one level per call; this call was fed several (a training batch): "
                         "it has no no-op setting there")
    return level


@dataclass
class PinSigma(Intervention):
    """Pin σ_cond at sigma_pin in every bin; a no-op in the bin σ = sigma_pin (its gate). Its noop() is
    None: the probe has that gate bin, and a machinery arm would cost it an arm in every bin. A sampler's
    steps have no such bin, so it declares level_noop(): sigma_pin = FOLLOW, the same pin (one fill of
    σ's dtype and device) at the level each call is fed, which is the twin's σ_cond bit for bit."""

    # σ fed to the conditioning pathway in every bin; must be a bin of the grid (its no-op gate).
    sigma_pin: float = 0.5
    name: ClassVar[str] = "pin_sigma"
    sweep_axis: ClassVar[str] = "sigma_pin"

    def __post_init__(self):
        self.sigma_pin = float(self.sigma_pin)

    def sigma_cond(self, sigma: torch.Tensor) -> torch.Tensor:
        # Same dtype and device as σ so that at the gate bin both arms feed bit-identical inputs.
        return torch.full_like(sigma, self.pinned(sigma))

    def pinned(self, sigma: torch.Tensor) -> float:
        """The level the pin fills σ_cond with: sigma_pin, or at FOLLOW the one level this call is fed
        (a sampler step and a probe bin feed one level to the whole batch; a float32 σ read as a Python
        float and filled back as float32 is the same number)."""
        if self.sigma_pin != FOLLOW:
            return self.sigma_pin
        return one_level(sigma, "pin_sigma at sigma_pin=0 (follow)")

    def level_noop(self) -> dict:
        return {"sigma_pin": FOLLOW}

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


@dataclass
class ScaleCond(Intervention):
    """Scale the conditioning signal c_noise = ln(σ)/4 about an anchor σ_a:
    ln σ_cond = ln σ_a + gamma·(ln σ − ln σ_a). gamma = 1 is native, gamma = 0 is pin_sigma at σ_a;
    in between it flattens how strongly the network is told the noise level. A no-op in the bin
    σ = σ_a: that bin is its gate. gamma = 1 is not declared its no-op setting: exp(ln σ) need not
    round back to σ, so that code path is close to the twin, not bit-identical to it. A sampler's steps
    have no such bin: its level_noop() anchors each call at the level it is fed (anchor_sigma = FOLLOW)."""

    # ln σ_cond = ln anchor_sigma + gamma·(ln σ − ln anchor_sigma); anchor_sigma must be a bin (its gate).
    anchor_sigma: float = 0.5
    gamma: float = 0.5  # 1 = native, 0 = pin at anchor_sigma
    name: ClassVar[str] = "scale_cond"
    sweep_axis: ClassVar[str] = "gamma"

    def __post_init__(self):
        self.anchor_sigma, self.gamma = float(self.anchor_sigma), float(self.gamma)

    def sigma_cond(self, sigma: torch.Tensor) -> torch.Tensor:
        if self.gamma == 1:  # native exactly (exp∘log does not round-trip): refused as a no-op everywhere
            return sigma
        anchor = self.anchor(sigma)
        log_a = math.log(anchor)
        scaled = torch.exp(log_a + self.gamma * (torch.log(sigma) - log_a))
        # exp(log(σ_a)) need not round back to σ_a: feed σ itself at the anchor, so the gate bin
        # is bit-identical to the twin.
        return torch.where(sigma == anchor, sigma, scaled)

    def anchor(self, sigma: torch.Tensor) -> float:
        """anchor_sigma, or at FOLLOW the one level this call is fed (sampling's machinery arm)."""
        if self.anchor_sigma != FOLLOW:
            return self.anchor_sigma
        return one_level(sigma, "scale_cond at anchor_sigma=0 (follow)")

    def level_noop(self) -> dict:
        # A sampler's steps have no gate bin; anchored at each call's own level, every step is the anchor
        # bin, so the arm runs the whole scaling (log, exp, the where) and must be the twin bit for bit.
        return {"anchor_sigma": FOLLOW}

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


def _scaled(output, factor: float):
    """output·factor for a module's output: a tensor or a tuple/list of tensors (e.g. adaLN chunks)."""
    if isinstance(output, torch.Tensor):
        return output * factor
    return type(output)(_scaled(o, factor) for o in output)


@dataclass
class ScaleModule(Intervention):
    """Scale a named module's output by `factor` at every σ (forward hook). factor = 0 ablates the
    module, factor = 1 is its no-op setting (x·1 == x exactly in IEEE arithmetic, so the machinery
    arm must be bit-identical to the twin). No bin is a no-op: the machinery arm is its gate."""

    # A name from model.named_modules() whose output is scaled at every σ (a forward hook).
    module: str = "blocks.1.attn"
    factor: float = 0.5  # 0 ablates the module; 1 is its no-op setting (the machinery arm runs it)
    name: ClassVar[str] = "scale_module"
    sweep_axis: ClassVar[str] = "factor"

    def __post_init__(self):
        self.module, self.factor = str(self.module), float(self.factor)

    def attach(self, model: torch.nn.Module) -> list:
        target = dict(model.named_modules())[self.module]
        return [target.register_forward_hook(lambda mod, args, output: _scaled(output, self.factor))]

    def noop(self) -> dict:
        return {"factor": 1.0}

    def check(self, grid: list[float]) -> None:
        if not math.isfinite(self.factor):
            raise ConfigError("intervention.factor", self.factor, "must be a finite number "
                              "(0 ablates, 1 = native)")

    def check_train(self) -> None:
        self.check([])  # its settings do not depend on a σ grid

    def check_model(self, model: torch.nn.Module) -> None:
        names = [n for n, _ in model.named_modules() if n]
        if self.module not in names:
            near = difflib.get_close_matches(self.module, names, n=3, cutoff=0.5) or names[:3]
            raise ConfigError("intervention.module", self.module,
                              f"no such module in the model; did you mean {', '.join(near)}? (one of the "
                              f"{len(names)} names of model.named_modules())")


@dataclass
class ScaleInput(Intervention):
    """Scale the denoiser's noisy input x by `factor` before the model sees it (a forward pre-hook on
    the model), at every σ: how much the model relies on the input's calibrated scale (EDM's c_in and
    c_skip both read x). factor = 1 is its no-op setting; the machinery arm is its gate."""

    # The denoiser's noisy input x is multiplied by this before the model sees it, at every σ.
    factor: float = 0.9  # 1 is its no-op setting (the machinery arm runs it)
    name: ClassVar[str] = "scale_input"
    sweep_axis: ClassVar[str] = "factor"

    def __post_init__(self):
        self.factor = float(self.factor)

    def attach(self, model: torch.nn.Module) -> list:
        def scale_x(mod, args):
            return (args[0] * self.factor, *args[1:])

        return [model.register_forward_pre_hook(scale_x)]

    def noop(self) -> dict:
        return {"factor": 1.0}

    def check(self, grid: list[float]) -> None:
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ConfigError("intervention.factor", self.factor, "must be a positive number (1 = native)")

    def check_train(self) -> None:
        self.check([])


@dataclass
class ScaleLR(Intervention):
    """Train with the learning rate multiplied by `factor` (a training intervention: the probe refuses it
    as a no-op everywhere). factor = 1 is its no-op setting: lr·1 == lr exactly, so its machinery arm
    must be bit-identical to the twin at every step."""

    factor: float = 2.0  # the arm's learning rate is the optimizer's lr times this; 1 is its no-op setting
    name: ClassVar[str] = "scale_lr"
    sweep_axis: ClassVar[str] = "factor"

    def __post_init__(self):
        self.factor = float(self.factor)

    def train_lr(self, lr: float) -> float:
        return lr * self.factor

    def noop(self) -> dict:
        return {"factor": 1.0}

    def check(self, grid: list[float]) -> None:
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ConfigError("intervention.factor", self.factor, "must be a positive number (1 = the "
                              "optimizer's own learning rate)")

    def check_train(self) -> None:
        self.check([])


@dataclass
class WeightSigma(Intervention):
    """Weight each sample's training loss by (σ/σ_data)^power on top of EDM's λ(σ) (Karras et al. 2022,
    Eq. 2): power > 0 leans training towards high noise, < 0 towards low noise. A training
    intervention acting on the loss. power = 0 is its no-op setting: x^0 == 1 exactly and the loss
    times 1 is the loss, so its machinery arm must be bit-identical to the twin at every step."""

    power: float = 1.0  # exponent of σ/σ_data in the per-sample loss weight; 0 is its no-op setting
    name: ClassVar[str] = "weight_sigma"
    sweep_axis: ClassVar[str] = "power"

    def __post_init__(self):
        self.power = float(self.power)

    def loss_weight(self, sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
        return (sigma / sigma_data) ** self.power

    def noop(self) -> dict:
        return {"power": 0.0}

    def check(self, grid: list[float]) -> None:
        if not math.isfinite(self.power):
            raise ConfigError("intervention.power", self.power, "must be a finite number (0 = EDM's own "
                              "loss weight)")

    def check_train(self) -> None:
        self.check([])


def set_dotted(tree: dict, key: str, value) -> dict:
    """A copy of a nested dict with the dotted `key` set to `value` (a whole node replaced, never merged)."""
    head, _, rest = key.partition(".")
    out = dict(tree)
    out[head] = set_dotted(tree.get(head) or {}, rest, value) if rest else copy.deepcopy(value)
    return out


@dataclass
class Override(Intervention):
    """Train with any training keys set to other values: `set` maps dotted keys under `train.` to values
    (e.g. {train.optimizer.weight_decay: 0.1}, {train.batch_size: 128}, a whole {train.optimizer: {...}}).
    Its twin is the run without it; its machinery arm runs this same code with the twin's own values,
    which must be bit-identical to the twin at every step. Which keys it may set is the training kind's
    to judge (twinrun/measures/train_override.py), which also hands it the twin's values (`bind`)."""

    # {dotted training key: value}; a node value replaces the twin's node whole (never merged into it).
    set: Any = None
    name: ClassVar[str] = "override"

    def __post_init__(self):
        if isinstance(self.set, DictConfig):  # Hydra's instantiate hands a nested node over as a DictConfig
            self.set = OmegaConf.to_container(self.set, resolve=True)
        self._twin_values: dict | None = None

    def bind(self, twin_values: dict) -> None:
        """The twin's value of every key it sets: its no-op setting."""
        self._twin_values = dict(twin_values)

    def noop(self) -> dict | None:
        return None if self._twin_values is None else {"set": dict(self._twin_values)}

    def train_settings(self, train: dict) -> dict:
        out = {"train": train}
        for key, value in (self.set or {}).items():
            out = set_dotted(out, key, value)
        return out["train"]

    def check(self, grid: list[float]) -> None:
        raise ConfigError("intervention.set", self.set, "an override sets training keys: it is a training "
                          "intervention (measure=train, e.g. +experiment=train_override)")


class attached:
    """`with attached(intervention, model):` its hooks are on the model inside the block only."""

    def __init__(self, intervention: Intervention, model: torch.nn.Module):
        self.intervention, self.model, self.handles = intervention, model, []

    def __enter__(self):
        self.handles = list(self.intervention.attach(self.model))
        return self.model

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


# The built-in interventions, each registered as its own schema under schema/intervention/<name>.
INTERVENTIONS: tuple[type[Intervention], ...] = (Native, PinSigma, ScaleCond, ScaleModule, ScaleInput,
                                                 ScaleLR, WeightSigma, Override)
