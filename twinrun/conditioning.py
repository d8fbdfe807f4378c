"""Per-image conditioning: class labels, text embeddings, pooled embeddings, masks, anything a model's
forward takes beside the noisy sample and its level.

A data builder may return a third element, a dict name -> tensor whose leading dimension is the number
of images. Each entry reaches the forward as the keyword argument of its name, taken and repeated
exactly as the images are (`take`, `per_draw`), so every sample sees its own image's conditioning. It is
part of what is measured: its bytes join the data's digest (`digest_items`). Everything about it is
checked before any compute (`check`): one line naming the key, exit 2.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from twinrun.errors import ConfigError

KEY = "data._target_"  # what a bad conditioning entry is blamed on: the builder that returned it


def split(data: tuple, key: str = KEY) -> tuple[torch.Tensor, list, dict[str, torch.Tensor]]:
    """(images, ids, cond) of a builder's (images, ids) or (images, ids, cond); cond {} when absent."""
    if not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
        raise ConfigError(key, type(data).__name__, "a data builder returns (images, ids) or (images, ids, "
                          "cond), cond a dict of per-image tensors (docs/bring-your-own.md)")
    images, ids = data[0], data[1]
    cond = data[2] if len(data) == 3 else {}
    if cond is None:
        cond = {}
    if not isinstance(cond, dict):
        raise ConfigError(key, type(cond).__name__, "the third element (the conditioning) must be a dict "
                          "name -> tensor [M, ...], one row per image")
    return images, ids, dict(cond)


def accepts(model: nn.Module, name: str) -> bool:
    """Whether the model's forward takes keyword argument `name` (by name or through **kwargs)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature: let the trial run judge it
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    p = params.get(name)
    return p is not None and p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                        inspect.Parameter.POSITIONAL_OR_KEYWORD)


def check(cond: dict, n_images: int, model: nn.Module | None = None, key: str = KEY) -> None:
    """One line naming the entry for conditioning the probe or training cannot feed (exit 2): a name that
    is not a string, a value that is not a tensor, a leading dimension other than the images', a NaN or
    inf, a name the model's forward does not accept (when the model is given)."""
    reserved = {"x", "sigma", "sigma_cond"}
    for name, value in cond.items():
        where = f"{key} cond[{name!r}]"
        if not isinstance(name, str) or not name.isidentifier() or name in reserved:
            raise ConfigError(where, name, "a conditioning name must be a keyword argument of the model's "
                              f"forward (an identifier, none of {sorted(reserved)})")
        if not isinstance(value, torch.Tensor):
            raise ConfigError(where, type(value).__name__, "must be a torch.Tensor with one row per image")
        if value.dim() == 0 or value.shape[0] != n_images:
            raise ConfigError(where, list(value.shape), f"its leading dimension must be the number of images "
                              f"({n_images}), one row per image")
        if (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise ConfigError(where, f"{bad} NaN/inf", "holds NaN or inf values; fix the cache or encoder")
        if model is not None and not accepts(model, name):
            raise ConfigError(where, name, f"the model's forward ({type(model).__name__}.forward) takes no "
                              "keyword argument of this name; rename the entry or accept it in the forward")


def take(cond: dict, index) -> dict:
    """Each entry's rows at `index`, exactly as the images are taken."""
    return {n: v[index] for n, v in cond.items()}


def to(cond: dict, device: torch.device) -> dict:
    return {n: v.to(device) for n, v in cond.items()}


def per_draw(cond: dict, n_draws: int) -> dict:
    """Each entry [k, ...] as [k·d, ...]: every image's row repeated for its d draws, in the order the
    samples are laid out (image-major: x.unsqueeze(1).expand(k, d, ...).reshape(k·d, ...))."""
    return {n: v.unsqueeze(1).expand(v.shape[0], n_draws, *v.shape[1:]).reshape(-1, *v.shape[1:])
            for n, v in cond.items()}


def digest_items(cond: dict) -> list[tuple[str, torch.Tensor]]:
    """The conditioning as (name, tensor) pairs for the data's digest, sorted by name (none: nothing is
    added, so a run without conditioning keeps its digest)."""
    return [(f"cond/{n}", cond[n]) for n in sorted(cond)]


class WithCond(nn.Module):
    """The model with the first image's conditioning fed to every sample: for twinrun's own fixed-input
    calls (the sentinel, the train-mode behaviour check, the memory estimate), which pass only
    (x, level, level_cond)."""

    def __init__(self, model: nn.Module, cond: dict):
        super().__init__()
        self.model = model
        self.training = model.training  # (the wrapper's own flag only: the model's modules keep theirs)
        self.first = {n: v[:1] for n, v in cond.items()}

    def forward(self, x, sigma, sigma_cond=None):
        batch = x.shape[0]
        extra = {n: v.expand(batch, *v.shape[1:]) for n, v in self.first.items()}
        return self.model(x, sigma, sigma_cond, **extra)


def with_first(model: nn.Module, cond: dict) -> nn.Module:
    """`WithCond(model, cond)`, or the model itself when there is no conditioning."""
    return WithCond(model, cond) if cond else model
