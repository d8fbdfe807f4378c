"""An arm's training state, held in memory for a whole job: the start model (its checkpoint read as
safetensors, never pickle), each arm's optimizer built around its intervention, the chaos arms' one-ulp
perturbations, and the weight and optimizer records a segment's store holds and a resume reads back.
"""

import copy
import difflib
import fnmatch
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch

from twinrun.config import ChaosConfig, TrainConfig
from twinrun.errors import ConfigError, StoreError
from twinrun.instantiate import build, typed
from twinrun.interventions import Intervention
from twinrun.measures import fold_sums as fs
from twinrun.measures import train_loop as loop
from twinrun.measures.failures import first_line
from twinrun.storage.safetensors_file import SafetensorsFile


@dataclass
class ArmState:
    """One arm's training state, held in memory for the whole job: its own model and optimizer."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    intervention: Intervention
    step: int  # the optimizer step its weights are at
    t: Any = None  # its own training settings (TrainConfig): the twin's, or an override's
    scheduler: Any = None  # its learning-rate scheduler (None: a constant rate)
    ema: Any = None  # its EMA of the weights (train_loop.EMA), or None
    step_fn: Any = None  # its step: twinrun's, or train.step._target_
    forward: Any = None  # what its step calls as the model: torch.compile's module of it (None: the model)
    scaler: Any = None  # its fp16 loss scaler (torch.amp.GradScaler), or None


def load_start(model: torch.nn.Module, path: str) -> None:
    """Load the start checkpoint into the model, read as untrusted input (SafetensorsFile: a regular file
    only, its header checked, its names and shapes held to the model's before any tensor is read), or
    one line saying how it does not match."""
    own = model.state_dict()
    try:
        with SafetensorsFile(Path(path).expanduser(), "checkpoint") as f:
            f.expect({name: list(t.shape) for name, t in own.items()})
            tensors = f.tensors()
    except StoreError as err:
        said = str(err).removeprefix(f"{Path(path).expanduser()}: ")
        if said.startswith("does not match"):
            raise ConfigError("train.start_checkpoint", path, f"{said} (the model); give a checkpoint of "
                              "this model's parameters, named as in model.state_dict()") from None
        raise ConfigError("train.start_checkpoint", path, f"is not a readable safetensors file ({said})") \
            from None
    model.load_state_dict(tensors, strict=True)


def build_start(config: dict, t: TrainConfig, device: torch.device) -> torch.nn.Module:
    """The start model every arm copies: the model's builder, then the start checkpoint if one is named."""
    model = build(config["model"], "model")
    if t.start_checkpoint is not None:
        load_start(model, t.start_checkpoint)
    freeze(model, list(t.params))
    return model.to(device).train()


def freeze(model: torch.nn.Module, patterns: list[str]) -> None:
    """Only the parameters matching `train.params` require gradients (the optimizer takes exactly them)."""
    names = {n for n, p in model.named_parameters() if any(fnmatch.fnmatchcase(n, q) for q in patterns)}
    if not names:
        raise ConfigError("train.params", patterns, "matches no parameter of the model; names look like "
                          f"{[n for n, _ in model.named_parameters()][:4]}")
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)


def validate_optimizer(node) -> None:
    if not isinstance(node, dict) or not isinstance(node.get("_target_"), str):
        raise ConfigError("train.optimizer", node, "must be a Hydra node with a _target_ (an optimizer class "
                          "taking the parameters as `params`), e.g. {_target_: torch.optim.AdamW, lr: 1e-3}")
    lr = node.get("lr")
    if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ConfigError("train.optimizer.lr", lr, "must be a positive number (the learning rate), "
                          "e.g. 1e-3")


def build_optimizer(node: dict, model: torch.nn.Module, intervention: Intervention) -> torch.optim.Optimizer:
    """The optimizer over the model's trainable parameters, at the arm's learning rate (the intervention's
    `train_lr` of each group's). One level, as Hydra's instantiate would build it: the class named by
    `_target_`, called with the parameters and the node's other keys (instantiate's own parsing of the
    node costs 20 ms, once per arm and once per plan)."""
    kwargs = {k: v for k, v in node.items() if not k.startswith("_")}
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        optimizer = hydra.utils.get_class(node["_target_"])(params, **kwargs)
    except Exception as err:  # noqa: BLE001 — the user's optimizer may raise anything: one line, exit 2
        raise ConfigError("train.optimizer._target_", node.get("_target_"), f"could not be built: "
                          f"{type(err).__name__}: {first_line(err)}") from None
    for group in optimizer.param_groups:
        group["lr"] = intervention.train_lr(group["lr"])
    return optimizer


def perturb(model: torch.nn.Module, name: str, index: int, ulps: int) -> None:
    """Move one element of one parameter by `ulps` units in the last place (torch.nextafter)."""
    param = dict(model.named_parameters())[name]
    flat = param.detach().view(-1)  # parameters are contiguous: the view writes the parameter itself
    towards = torch.tensor(math.inf if ulps > 0 else -math.inf, dtype=param.dtype, device=param.device)
    value = flat[index].clone()
    for _ in range(abs(ulps)):
        value = torch.nextafter(value, towards)
    flat[index] = value


def perturb_every(model: torch.nn.Module, ulps: int, seed: int) -> None:
    """Move every nonzero element of every trained floating-point parameter by |ulps| ulps, up or down by
    a coin from a generator seeded with `seed` (drawn on the CPU in named_parameters() order, so a GPU
    run's chaos arm starts where the CPU's does). A zero stays zero: no rounding leaves a wobble on it,
    and a subnormal would be an ulp of another scale. A frozen weight (train.params) is left alone: no
    gradient is ever reduced into it."""
    coins = torch.Generator().manual_seed(seed)
    for _, param in model.named_parameters():
        if not (param.is_floating_point() and param.requires_grad):
            continue
        up = torch.randint(0, 2, param.shape, generator=coins, dtype=torch.bool).to(param.device)
        towards = torch.where(up, math.inf, -math.inf).to(param.dtype)
        value = param.detach().clone()
        for _ in range(abs(ulps)):
            value = torch.nextafter(value, towards)
        with torch.no_grad():
            param.copy_(torch.where(param == 0, param, value))


def chaos_seed(run_seed: int, k: int) -> int:
    """The coins of the k-th chaos arm (k from 1): another seed, other coins; the run's seed, another draw."""
    return (run_seed * 1_000_003 + k) % 2**63


DEFAULT_CHAOS_PARAM = ChaosConfig.param


def check_chaos(model: torch.nn.Module, c) -> None:
    """The chaos arm's weight must exist, be floating point and hold the element."""
    params = dict(model.named_parameters())
    if c.param not in params:
        near = difflib.get_close_matches(c.param, list(params), n=3, cutoff=0.5) or list(params)[:3]
        default = " (the default names the committed DiT's weight: a model of your own sets it)" \
            if c.param == DEFAULT_CHAOS_PARAM else ""
        raise ConfigError("train.chaos.param", c.param, f"no such parameter in this model{default}; set "
                          f"train.chaos.param to one of its {len(params)} model.named_parameters(), e.g. "
                          f"{', '.join(near)}")
    param = params[c.param]
    if not param.is_floating_point() or not param.is_contiguous():
        raise ConfigError("train.chaos.param", c.param, "must be a contiguous floating-point parameter")
    if not 0 <= c.index < param.numel():
        raise ConfigError("train.chaos.index", c.index, f"{c.param} has {param.numel()} elements; use 0 … "
                          f"{param.numel() - 1}")


def weight_layout(model: torch.nn.Module) -> list[dict]:
    """The stored weights: every parameter, in named_parameters() order, with its shape and whether it
    belongs to the conditioning pathway (the `cond` estimand, as the probe's layout says)."""
    names = [n for n, _ in model.named_parameters()]
    return [{"name": g["name"], "shape": g["shape"], "cond": g["cond"]}
            for g in fs.layout(model, names, fs.cond_patterns(model))]


def model_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def buffer_names(model: torch.nn.Module) -> list[str]:
    """The persistent buffers (in state_dict but not parameters: e.g. running statistics): stored and
    restored with the weights, so a resumed arm continues exactly where it stopped."""
    params = {n for n, _ in model.named_parameters()}
    return [n for n in model.state_dict() if n not in params]


def _plain(value):
    """A param-group value as JSON (a record only: groups are rebuilt from the config on resume)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    return str(value)


def optimizer_record(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> tuple[dict, dict]:
    """(tensors `optim/<parameter>/<key>`, metadata) of an optimizer's state, keyed by parameter name: any
    torch optimizer's state (a tensor is stored as a tensor, any other value in the metadata)."""
    sd = optimizer.state_dict()
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    tensors, scalars = {}, {}
    for i, per in sd["state"].items():
        for key, value in per.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{order[i]}/{key}"] = value.detach().cpu()
            else:
                scalars.setdefault(order[i], {})[key] = _plain(value)
    groups = [{k: _plain(v) for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    cls = type(optimizer)
    return tensors, {"class": f"{cls.__module__}.{cls.__qualname__}", "param_groups": groups,
                     "scalars": scalars}


def restore_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], tensors: dict,
                      meta: dict) -> None:
    """The optimizer's state read back from a store (its param groups are the freshly built ones)."""
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    index_of = {n: i for i, n in enumerate(order)}
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            name, _, field = key.removeprefix("optim/").rpartition("/")
            state.setdefault(index_of[name], {})[field] = value.clone()  # not a view: the store's bytes go
    for name, values in meta["optimizer"]["scalars"].items():
        state.setdefault(index_of[name], {}).update(values)
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


def build_arm(start: torch.nn.Module, train: dict, intervention: Intervention, own: bool = False) -> ArmState:
    """An arm's model (a copy of the start; `own`: the start itself, a copy the caller made for this arm
    alone), optimizer, scheduler, EMA, step and fp16 grad scaler, from its own training settings `train`
    (the twin's, or an override's)."""
    model = start if own else copy.deepcopy(start)
    optimizer = build_optimizer(train["optimizer"], model, intervention)
    t = typed(TrainConfig, train, "train")
    device = next(model.parameters()).device
    return ArmState(model, optimizer, intervention, 0, t, loop.build_schedule(train.get("schedule"),
                                                                              optimizer),
                    loop.build_ema(t.ema, model), loop.build_step(train.get("step")),
                    scaler=loop.build_scaler(t, device))
