"""Plugins, the Python way: measurement kinds, interventions and objectives another installed package
declares as entry points, found by name like a built-in.

A package names them in its own pyproject.toml:

    [project.entry-points."twinrun.measures"]
    activation = "my_probes.activation:ACTIVATION"      # a twinrun.measures.kind.Measure

    [project.entry-points."twinrun.interventions"]
    my_scale = "my_probes.interventions:MyScale"         # an Intervention dataclass

A measurement kind is loaded only when a config (or a run's run.json) names it. An intervention is
loaded when twinrun's configs are registered: Hydra composes `intervention=NAME` from its schema,
which is its class. What a run directory names is never imported without `--trust` beyond this:
an entry point is code its user installed, as twinrun itself is.
"""

import dataclasses
import sys
from importlib.metadata import EntryPoint, entry_points

from twinrun.errors import ConfigError

MEASURES_GROUP = "twinrun.measures"
INTERVENTIONS_GROUP = "twinrun.interventions"
OBJECTIVES_GROUP = "twinrun.objectives"  # the objectives' registry (twinrun/objectives.py) plugs in here


def installed(group: str) -> dict[str, EntryPoint]:
    """The entry points of `group` every installed distribution declares, by name (the first wins)."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=group):
        found.setdefault(ep.name, ep)
    return found


def names(group: str, builtin) -> list[str]:
    """Every name `group` can select: the built-in ones first, then the installed plugins'."""
    return list(dict.fromkeys([*builtin, *installed(group)]))


def lookup(group: str, key: str, name: str, builtin: dict):
    """The built-in or installed object `name` selects, or a one-line ConfigError (exit 2) naming `key`
    and listing the installed choices; a plugin that fails to load is one line too."""
    if name in builtin:
        return builtin[name]
    plugins = installed(group)
    if name not in plugins:
        raise ConfigError(key, name, f"not built in and no installed package declares it (entry point group "
                          f"{group}); choose one of {', '.join(names(group, builtin))}")
    try:
        return plugins[name].load()
    except Exception as err:  # noqa: BLE001 — a plugin is foreign code: its failure to import is one line
        raise ConfigError(key, name, f"the plugin {plugins[name].value} failed to load "
                          f"({type(err).__name__}: {err}); fix or reinstall its package") from None


def plugin_interventions(builtin) -> dict[str, type]:
    """Every installed plugin intervention class by its entry point name (a built-in name is never
    shadowed); one that fails to load, or is no dataclass, is a one-line warning and left out."""
    taken = {cls.name for cls in builtin}
    found = {}
    for name, ep in installed(INTERVENTIONS_GROUP).items():
        if name in taken:
            continue
        try:
            cls = ep.load()
        except Exception as err:  # noqa: BLE001 — foreign code: its failure is one line, not a traceback
            print(f"twinrun: warning: plugin intervention {name} ({ep.value}) failed to load "
                  f"({type(err).__name__}: {err}); left out", file=sys.stderr)
            continue
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            found[name] = cls
    return found
