"""Estimands: named linear views of the stored fold sums, selected by parameter name.

An estimand is one registry entry: which parameters it reads (a selection over the store's layout)
and whether the twin's mean over bins is removed (a derived view). The built-ins are `all`, `cond`
and `residual`; `reduce.groups` adds one entry per named group of fnmatch patterns over parameter
names (e.g. `block0: ["blocks.0.*"]`), so a per-layer estimand needs only config. Config validation,
the reducer, the report's ordering, references and `compare` all read `registry()`. Since every view
is linear in the sums, nothing extra is ever stored. The Gram blocks are accumulated by twinrun.scan.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase

from twinrun.errors import ConfigError

GROUP_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Estimand:
    name: str
    doc: str
    selects: Callable[[dict], bool]  # layout entry -> are its columns part of this view?
    residual: bool = False  # remove the twin's mean direction over bins (shared structure)


ESTIMANDS = {e.name: e for e in (
    Estimand("all", "every probed parameter", lambda entry: True),
    Estimand("cond", "the conditioning pathway (the model's COND_PARAM_PATTERNS)", lambda entry: bool(entry["cond"])),
    Estimand("residual", "each bin's direction minus the twin's mean direction over bins", lambda entry: True,
             residual=True),
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
        raise ConfigError("reduce.groups", groups, "must map a group name to a list of parameter-name patterns, "
                          'e.g. reduce.groups={block0:["blocks.0.*"]}')
    for name, pats in groups.items():
        key = f"reduce.groups.{name}"
        if not isinstance(name, str) or not GROUP_NAME.fullmatch(name) or name in ESTIMANDS:
            raise ConfigError(key, pats, f"a group name is a letter then letters, digits or '_', and not one of the "
                              f"built-in estimands ({', '.join(ESTIMANDS)}); rename the group")
        if not isinstance(pats, list | tuple) or not pats or not all(isinstance(p, str) and p for p in pats):
            raise ConfigError(key, pats, 'must be a non-empty list of fnmatch patterns, e.g. ["blocks.0.*"]')


def check_estimands(names, groups, layout: list[dict] | None, what: str = "reduce.estimands") -> None:
    """Refuse, as one line naming the key, an unknown estimand or a group that selects no probed parameter.

    layout None: the names only (the parameters are not known yet)."""
    check_groups(groups)
    known = registry(groups)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ConfigError(what, list(names), f"{unknown or 'empty'}: choose from {', '.join(known)} (a new one is a "
                          'group: reduce.groups={NAME:["PATTERN", ...]})')
    if layout is None:
        return
    for name in (n for n in names if n in groups):
        if not any(known[name].selects(entry) for entry in layout):
            raise ConfigError(f"reduce.groups.{name}", list(groups[name]), "matches no probed parameter (parameters "
                              f"look like {', '.join(e['name'] for e in layout[:3])}); fix the pattern or probe.params")
    if "cond" in names and not any(known["cond"].selects(entry) for entry in layout):
        raise ConfigError(what, list(names), "`cond` needs conditioning parameters among probe.params (the model "
                          "declares none among them); drop `cond` or probe them")


def views(layout_entry: dict, names: list[str], groups: dict | None = None) -> tuple[str, ...]:
    """The estimands (of `names`) that read this parameter's columns."""
    known = registry(groups)
    return tuple(n for n in names if known[n].selects(layout_entry))
