"""Interventions: what an arm changes. The native twin changes nothing.

An intervention is a small object built from config by one level of Hydra `_target_`. It may act
at three places, each optional (the base class's defaults do nothing):
  sigma_cond(sigma)    the σ fed to the denoiser's conditioning pathway at noising σ,
  attach(model)        forward hooks by module name: a module's output, the model's inputs,
                       returning the handles that remove them after the arm's measurement,
and it declares how it can be checked against its twin:
  gate_sigmas(grid)    the bins where it is a no-op: there it must be bit-identical to its twin,
  noop()               its no-op setting (overrides of its own config keys), or None: twinrun runs
                       the intervention's own code at that setting as the *machinery arm*, which must
                       be bit-identical to the twin in every bin,
  sweep_axis           the config key a sweep over this intervention varies,
  check(grid), check_model(model)   raise ConfigError for settings it cannot run with.
An intervention with neither a gate bin nor a no-op setting proves nothing and is refused.
"""

import difflib
import math

import torch

from twinrun.errors import ConfigError


class Intervention:
    """Defaults: the twin's behaviour everywhere, no gate bin, no no-op setting."""

    name = "intervention"
    sweep_axis: str | None = None

    def sigma_cond(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma

    def attach(self, model: torch.nn.Module) -> list:
        return []

    def gate_sigmas(self, grid: list[float]) -> list[float]:
        return []

    def noop(self) -> dict | None:
        return None

    def check(self, grid: list[float]) -> None:
        pass

    def check_model(self, model: torch.nn.Module) -> None:
        pass


class Native(Intervention):
    """The twin: σ_cond = σ, no hooks."""

    name = "native"

    def gate_sigmas(self, grid: list[float]) -> list[float]:
        return list(grid)


class PinSigma(Intervention):
    """Pin σ_cond at sigma_pin in every bin; a no-op in the bin σ = sigma_pin (its gate). It has no
    no-op setting of its own: a pin that follows σ is no longer a pin."""

    name = "pin_sigma"
    sweep_axis = "sigma_pin"

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


class ScaleCond(Intervention):
    """Scale the conditioning signal c_noise = ln(σ)/4 about an anchor σ_a:
    ln σ_cond = ln σ_a + gamma·(ln σ − ln σ_a). gamma = 1 is native, gamma = 0 is pin_sigma at σ_a;
    in between it flattens how strongly the network is told the noise level. A no-op in the bin
    σ = σ_a: that bin is its gate. gamma = 1 is not declared its no-op setting: exp(ln σ) need not
    round back to σ, so that code path is close to the twin, not bit-identical to it."""

    name = "scale_cond"
    sweep_axis = "gamma"

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


def _scaled(output, factor: float):
    """output·factor for a module's output: a tensor or a tuple/list of tensors (e.g. adaLN chunks)."""
    if isinstance(output, torch.Tensor):
        return output * factor
    return type(output)(_scaled(o, factor) for o in output)


class ScaleModule(Intervention):
    """Scale a named module's output by `factor` at every σ (forward hook). factor = 0 ablates the
    module, factor = 1 is its no-op setting (x·1 == x exactly in IEEE arithmetic, so the machinery
    arm must be bit-identical to the twin). No bin is a no-op: the machinery arm is its gate."""

    name = "scale_module"
    sweep_axis = "factor"

    def __init__(self, module: str, factor: float):
        self.module, self.factor = str(module), float(factor)

    def attach(self, model: torch.nn.Module) -> list:
        target = dict(model.named_modules())[self.module]
        return [target.register_forward_hook(lambda mod, args, output: _scaled(output, self.factor))]

    def noop(self) -> dict:
        return {"factor": 1.0}

    def check(self, grid: list[float]) -> None:
        if not math.isfinite(self.factor):
            raise ConfigError("intervention.factor", self.factor, "must be a finite number (0 ablates, 1 = native)")

    def check_model(self, model: torch.nn.Module) -> None:
        names = [n for n, _ in model.named_modules() if n]
        if self.module not in names:
            near = difflib.get_close_matches(self.module, names, n=3, cutoff=0.5) or names[:3]
            raise ConfigError("intervention.module", self.module,
                              f"no such module in the model; did you mean {', '.join(near)}? (one of the "
                              f"{len(names)} names of model.named_modules())")


class ScaleInput(Intervention):
    """Scale the denoiser's noisy input x by `factor` before the model sees it (a forward pre-hook on
    the model), at every σ: how much the model relies on the input's calibrated scale (EDM's c_in and
    c_skip both read x). factor = 1 is its no-op setting; the machinery arm is its gate."""

    name = "scale_input"
    sweep_axis = "factor"

    def __init__(self, factor: float):
        self.factor = float(factor)

    def attach(self, model: torch.nn.Module) -> list:
        def scale_x(mod, args):
            return (args[0] * self.factor, *args[1:])

        return [model.register_forward_pre_hook(scale_x)]

    def noop(self) -> dict:
        return {"factor": 1.0}

    def check(self, grid: list[float]) -> None:
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ConfigError("intervention.factor", self.factor, "must be a positive number (1 = native)")


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
