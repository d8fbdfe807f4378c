"""Intervention config nodes: each class's schema for Hydra, the protocol an object built from
`intervention._target_` must follow, and a node read back from a run directory (its class looked up,
never imported; its sweep axis)."""

import dataclasses
import sys
from types import ModuleType

from twinrun.errors import ConfigError
from twinrun.interventions import Intervention


def target(cls: type) -> str:
    """The `_target_` that builds the class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def schema(cls: type[Intervention]) -> type:
    """The class's config schema: its own fields, with the `_target_` that builds it first."""
    own = [(f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(f"{cls.__name__}Config", [("_target_", str, target(cls)), *own])


# What planning, the job and the reducer call on an intervention (the base class defines every one).
PROTOCOL = ("sigma_cond", "attach", "gate_sigmas", "noop", "check", "check_model")


def check_protocol(obj, target) -> None:
    """Refuse, naming the first missing method, an object built from `intervention._target_` that is not
    an intervention: planning and the job would otherwise fail deep inside with an AttributeError."""
    missing = [m for m in PROTOCOL if not callable(getattr(obj, m, None))]
    name = getattr(obj, "name", None)
    if missing:
        raise ConfigError("intervention._target_", target, f"built a {type(obj).__name__}, which lacks the "
                          f"method {missing[0]}() of the Intervention protocol ({', '.join(PROTOCOL)}); "
                          "subclass twinrun.interventions.Intervention, whose defaults do nothing")
    if not isinstance(name, str):
        raise ConfigError("intervention._target_", target, f"built a {type(obj).__name__} without a `name` "
                          "(its arm directory); subclass twinrun.interventions.Intervention and set one")


def known_class(node: dict) -> type | None:
    """The class an `intervention` node names, looked up, never imported: twinrun's own, or one this
    process already imported to build it (a run directory names code; reading one must not run any)."""
    module, _, name = str(node.get("_target_", "")).rpartition(".")
    owner = sys.modules.get(module)  # twinrun.interventions itself is imported above
    # vars(), not getattr: a module's __getattr__ (PEP 562 lazy loaders) could import on a name read
    # from disk.
    cls = vars(owner).get(name) if isinstance(owner, ModuleType) else None
    return cls if isinstance(cls, type) else None


def rebuild(node: dict) -> "Intervention | None":
    """An arm's intervention rebuilt from its resolved config node, so a reader can recompute what it does
    (σ_cond, gate bins) against what a run recorded: only a dataclass subclass of Intervention that
    `known_class` finds (never an import), called with the node's own fields; None otherwise. A node its
    class does not accept is a TypeError or a ConfigError for the caller to name."""
    cls = known_class(node)
    if cls is None or not issubclass(cls, Intervention) or not dataclasses.is_dataclass(cls):
        return None
    return cls(**{k: v for k, v in node.items() if k != "_target_"})


def sweep_axis(node: dict) -> dict | None:
    """The axis an arm's `intervention` node declares (its class's `sweep_axis`) and its value there,
    {"key": "intervention.<axis>", "value": ...}; None if it declares none (`known_class`: never an
    import)."""
    cls = known_class(node)
    axis = getattr(cls, "sweep_axis", None) if isinstance(cls, type) else None
    if not isinstance(axis, str) or axis not in node:
        return None
    return {"key": f"intervention.{axis}", "value": node[axis]}
