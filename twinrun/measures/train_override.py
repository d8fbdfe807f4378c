"""A config override as a training intervention (`intervention=override`, `intervention.set`): which keys
it may set, the twin's values its machinery arm sets instead, and each arm's training settings as it
trains them.

The machinery arm runs the override's own mechanism (a copy of the `train` node with the keys set) with
the twin's values, so it must be bit-identical to the twin at every step: the gate. Keys that change what
is measured rather than how it is trained are refused, each with its reason. docs/training.md.
"""

from omegaconf import DictConfig, OmegaConf

from twinrun.config import TrainConfig
from twinrun.errors import ConfigError
from twinrun.instantiate import typed
from twinrun.interventions import Intervention, Override
from twinrun.measures.train_loop import check_loop
from twinrun.measures.train_state import validate_optimizer

# What is measured, shared by every arm, rather than how an arm trains: refused, with the reason.
REFUSED = {
    "train.steps": "every arm trains as many steps and stores at the same steps (the units are shared)",
    "train.segment_steps": "every arm stores at the same steps (the units are shared)",
    "train.heldout_images": "the held-out set is what every arm is measured on",
    "train.start_checkpoint": "every arm starts from one checkpoint (the distances are read from it)",
    "train.chaos": "the chaos arm's perturbation is the floor's, not an arm's training",
    "train.floor_margin": "the verdict's margin is the reading's, not an arm's training",
    "train.floor_scope": "which floor the verdict reads is the reading's, not an arm's training",
    "train.device": "every arm trains on the run's device (one kernel path)",
    "train.compile": "compiling is the run's kernel path, shared by every arm",
    "train.offload": "where parked arms wait is the run's memory layout, not an arm's training",
    "train.replicate_segments": "the replicate's protocol is the run's",
}
REFUSED_ROOTS = {
    "data": "the data is what every arm is trained and measured on",
    "seed": "the seed keys the samples and noise every arm shares",
    "model": "the arms are compared weight by weight, so every arm trains the same model",
}


def check_override(cfg: DictConfig, intervention: Intervention) -> None:
    """An override's keys, before any compute: each under `train.`, present in the twin's config and not
    refused; then hand it the twin's values (its no-op setting). Any other intervention passes."""
    if not isinstance(intervention, Override):
        return
    node = intervention.set
    if not isinstance(node, dict) or not node:
        raise ConfigError("intervention.set", node, "must map training keys to their values, e.g. "
                          "'intervention.set={train.optimizer.weight_decay: 0.1}'")
    twin = {"train": OmegaConf.to_container(cfg.train, resolve=True)}
    values = {}
    for key in node:
        refuse_key(key, node[key])
        found, value = _lookup(twin, key)
        if not found:
            parent = key.rpartition(".")[0]
            raise ConfigError(f"intervention.set[{key}]", node[key], f"the twin's config has no {key}, so "
                              f"its machinery arm has no value to set; set the whole node instead "
                              f"({parent}: {{...}})")
        values[key] = value
    intervention.bind(values)


def refuse_key(key, value) -> None:
    """One line naming a key an override may not set, and why."""
    if not isinstance(key, str) or not key:
        raise ConfigError("intervention.set", key, "its keys are dotted training keys, e.g. train.batch_size")
    root = key.split(".")[0]
    if root in REFUSED_ROOTS:
        raise ConfigError(f"intervention.set[{key}]", value, f"refused: {REFUSED_ROOTS[root]}")
    if root != "train":
        raise ConfigError(f"intervention.set[{key}]", value, "refused: an override sets how an arm is "
                          "trained, keys under train. only (e.g. train.optimizer.weight_decay)")
    for prefix, reason in REFUSED.items():
        if key == prefix or key.startswith(prefix + "."):
            raise ConfigError(f"intervention.set[{key}]", value, f"refused: {reason}")


def _lookup(tree: dict, key: str) -> tuple[bool, object]:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False, None
        tree = tree[part]
    return True, tree


def arm_train(arm_config: dict, intervention: Intervention) -> dict:
    """An arm's training settings as it trains them: its `train` node through its intervention's
    `train_settings` (an override's keys set; every other intervention's node as it is)."""
    return intervention.train_settings(arm_config["train"])


def validate_arm_settings(train: dict, n_train: int) -> None:
    """The intervention arm's own training settings where an override sets them: the same rules as the
    twin's, the key named as the override's (`intervention.set[train.batch_size]`)."""
    try:
        b, chunk, acc = train.get("batch_size"), train.get("chunk_samples"), train.get("accumulate", 1)
        if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b * max(1, acc) <= n_train:
            raise ConfigError("train.batch_size", b, f"must be a positive integer, at most the training "
                              f"split's {n_train} images")
        if not isinstance(chunk, int) or chunk == 0 or chunk < -1:
            raise ConfigError("train.chunk_samples", chunk, "must be ≥ 1, or -1 for the whole batch")
        validate_optimizer(train.get("optimizer"))
        check_loop(typed(TrainConfig, train, "intervention.set"))
    except ConfigError as err:
        raise ConfigError(f"intervention.set[{err.key}]", err.value, err.fix) from None
