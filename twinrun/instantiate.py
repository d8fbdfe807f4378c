"""Config nodes into objects: one level of Hydra's instantiate (model, data, intervention, objective) and
a plain node read back as its schema's dataclass, each failure one line naming the key or the file."""

from typing import Any

import hydra
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from twinrun.errors import ConfigError, StoreError
from twinrun.objectives import EDM, Objective


def build(node: dict, key: str):
    """One level of Hydra instantiate (a config node becomes its object), with a one-line error naming
    the key."""
    try:
        return hydra.utils.instantiate(node)
    except Exception as err:  # noqa: BLE001 — instantiate wraps every builder failure in its own exception
        cause = err.__cause__ or err
        msg = (str(cause).strip().splitlines() or [type(cause).__name__])[-1]
        raise ConfigError(f"{key}._target_", node.get("_target_"), f"could not be built: {msg}") from None


def objective_of(node: dict | None) -> Objective:
    """An arm's objective from its resolved config's `objective` node (one level of `_target_`); a config
    without one (a run recorded before objectives were configurable) is `edm`, which it ran."""
    if not node:
        return EDM()
    obj = build(node, "objective")
    if not isinstance(obj, Objective):
        raise ConfigError("objective._target_", node.get("_target_"), "built a "
                          f"{type(obj).__name__}, not an objective: subclass twinrun.objectives.Objective "
                          "(docs/objectives.md)")
    return obj


def typed(schema: type, node: dict, where) -> Any:
    """A plain config node (an arm's resolved config.yaml part) as its schema's dataclass: keys it
    lacks take the schema's defaults, so no reader restates a default. `where` names the file in the
    one-line error a node of the wrong shape gives (exit 2)."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))
    except OmegaConfBaseException as err:
        raise StoreError(where, f"does not fit the {schema.__name__} schema "
                         f"({str(err).splitlines()[0]})") from None
