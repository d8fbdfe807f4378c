"""Estimands: named linear views of the stored fold sums, selected by parameter name.

An estimand is one registry entry: which parameters it reads (a selection over the store's layout)
and, for a derived view, a `derive` entry saying how its Gram blocks follow from what the scan
accumulates. The built-ins are `all`, `cond` and `residual` (derived: the base arm's mean direction
over bins removed); `reduce.groups` adds one entry per named group of fnmatch patterns over parameter names
(e.g. `block0: ["blocks.0.*"]`), so a per-layer estimand needs only config. Config validation, the
reducer, the report's ordering, references and `compare` all read `registry()`. Since every view is
linear in the sums, nothing extra is ever stored. The Gram blocks are accumulated by
twinrun.analysis.scan.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from omegaconf import DictConfig, OmegaConf

from twinrun.analysis.estimator import residual_gram
from twinrun.errors import ConfigError

GROUP_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


class MinusBaseMean:
    """A derived view: each bin's mean gradient minus the base arm's mean *direction* over the bins, scaled
    to that bin's base norm (shared structure removed; docs/estimator.md, "The residual view").

    Per fold R_{b,a,f} = S_{b,a,f} − c_b·M_f, with c_b the base arm's plain mean-gradient norm at bin b and
    M_f = (1/B) Σ_b' S_{b',base,f} / c_b': every bin weighs the same in the mean direction, whatever its
    |μ|. Its Gram follows from the within-bin products and every row against every bin's base rows
    (`partials`, summed over column chunks; twinrun.analysis.estimator.residual_gram)."""

    def partials(self, x: torch.Tensor, base: int) -> torch.Tensor:
        """cross[b, a, f, b', g] = ⟨S_{b,a,f}, S_{b',base,g}⟩ [bins, arms, F, bins, F] of one column chunk
        x [bins, arms, F, width]."""
        n_bins, n_arms, n_folds, width = x.shape
        rows = x.reshape(n_bins * n_arms * n_folds, width)
        return (rows @ x[:, base].reshape(n_bins * n_folds, width).T).view(n_bins, n_arms, n_folds, n_bins,
                                                                             n_folds)

    def gram(self, g: torch.Tensor, cross: torch.Tensor, n_arms: int, base: int,
             n_samples: float) -> torch.Tensor:
        """The derived view's within-bin Gram blocks [bins, arms·F, arms·F] from the plain ones `g`."""
        n_bins, n_folds = cross.shape[0], cross.shape[-1]
        within = g.view(n_bins, n_arms, n_folds, n_arms, n_folds).numpy()
        out = residual_gram(within, cross.numpy(), base, n_samples)
        return torch.from_numpy(out).view(n_bins, n_arms * n_folds, n_arms * n_folds)


@dataclass(frozen=True)
class Estimand:
    name: str
    doc: str
    selects: Callable[[dict], bool]  # layout entry -> are its columns part of this view?
    # a derived view of the selected columns (None: the columns as stored)
    derive: MinusBaseMean | None = None


# The view whose shift (max relative difference of the sums) the replicate, the gates' size and
# references read: every probed parameter. A derived view removes the same mean from both sides of a
# comparison, so its shift would be the same numbers.
SHIFT_VIEW = "all"

ESTIMANDS = {e.name: e for e in (
    Estimand(SHIFT_VIEW, "every probed parameter", lambda entry: True),
    Estimand("cond", "the conditioning pathway (the model's COND_PARAM_PATTERNS)",
             lambda entry: bool(entry["cond"])),
    Estimand("residual", "each bin's mean gradient minus the twin's mean direction over the grid's bins, "
             "scaled to the bin's twin norm", lambda entry: True, derive=MinusBaseMean()),
)}


def group(name: str, patterns: list[str]) -> Estimand:
    """A named parameter group: the parameters whose names match any of the fnmatch patterns."""
    pats = tuple(patterns)
    return Estimand(name, f"parameters matching {', '.join(pats)}",
                    lambda entry: any(fnmatchcase(entry["name"], p) for p in pats))


def registry(groups: dict | None = None) -> dict[str, Estimand]:
    """The built-in estimands, then one per configured group (reduce.groups), in that order."""
    return {**ESTIMANDS, **{name: group(name, pats) for name, pats in (groups or {}).items()}}


def available(layout: list[dict], groups: dict | None = None) -> list[str]:
    """Estimands that select at least one probed parameter of this layout, in registry order."""
    return [name for name, e in registry(groups).items() if any(e.selects(entry) for entry in layout)]


def check_groups(groups) -> None:
    """reduce.groups: {name: [fnmatch pattern, ...]} with names that are not built-ins."""
    if not isinstance(groups, dict):
        raise ConfigError("reduce.groups", groups, "must map a group name to a list of parameter-name "
                          'patterns, e.g. reduce.groups={block0:["blocks.0.*"]}')
    for name, pats in groups.items():
        key = f"reduce.groups.{name}"
        if not isinstance(name, str) or not GROUP_NAME.fullmatch(name) or name in ESTIMANDS:
            raise ConfigError(key, pats, "a group name is a letter then letters, digits or '_', and not one "
                              f"of the built-in estimands ({', '.join(ESTIMANDS)}); rename the group")
        if not isinstance(pats, list | tuple) or not pats or not all(isinstance(p, str) and p for p in pats):
            raise ConfigError(key, pats, 'must be a non-empty list of fnmatch patterns, e.g. ["blocks.0.*"]')


def check_estimands(names, groups, layout: list[dict] | None, what: str = "reduce.estimands",
                    groups_what: str = "reduce.groups", params_key: str | None = "probe.params") -> None:
    """Refuse, as one line naming the key, an unknown estimand or a group that selects no probed parameter
    (every group declared, listed among `names` or not: it is registered with the run either way).

    layout None: the names only (the parameters are not known yet). params_key: the setting that chose
    the parameters (None: every parameter of the model, as a training run compares them)."""
    # Names are checked even before the parameters are known (plan time), so a typo fails before any compute;
    # the checks against the layout follow once the stores name their parameters.
    check_groups(groups)
    known = registry(groups)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ConfigError(what, list(names), f"{unknown or 'empty'}: choose from {', '.join(known)} (a new "
                          'one is a group: reduce.groups={NAME:["PATTERN", ...]})')
    if layout is None:
        return
    # A group that selects nothing would be registered and read as an estimand over no parameters: every
    # declared group, listed or not, must select one.
    for name in groups:
        if not any(known[name].selects(entry) for entry in layout):
            raise ConfigError(f"{groups_what}.{name}", list(groups[name]), f"matches no "
                              f"{'probed ' if params_key else ''}parameter "
                              f"(parameters look like {', '.join(e['name'] for e in layout[:3])}); fix the "
                              f"pattern{f' or {params_key}' if params_key else ''}")
    # `cond` reads the conditioning pathway: on a model that declares none it would be an estimand over
    # nothing.
    if "cond" in names and not any(known["cond"].selects(entry) for entry in layout):
        among, them = (f" among {params_key}", " among them") if params_key else ("", "")
        raise ConfigError(what, list(names), f"`cond` needs conditioning parameters{among} (the model "
                          f"declares none{them}); drop `cond`{' or probe them' if params_key else ''}")


def declared_groups(r: DictConfig) -> dict[str, list[str]]:
    """reduce.groups as plain data ({} when none is declared): the estimand groups of the config."""
    return OmegaConf.to_container(r, resolve=True)["groups"] or {}


def views(layout_entry: dict, names: list[str], groups: dict | None = None) -> tuple[str, ...]:
    """The estimands (of `names`) that read this parameter's columns."""
    known = registry(groups)
    return tuple(n for n in names if known[n].selects(layout_entry))
