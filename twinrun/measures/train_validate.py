"""A training run's settings, intervention and data judged before any compute (`measure=train`'s
validate): each error one line naming the key, the value and the fix. docs/training.md.
"""

import math

from omegaconf import DictConfig, OmegaConf

from twinrun import conditioning
from twinrun.analysis.train_reduce import refuse_derived
from twinrun.config import ChaosConfig
from twinrun.errors import ConfigError
from twinrun.instantiate import build
from twinrun.interventions import Intervention, acts_through
from twinrun.measures import train_loop as loop
from twinrun.measures import trial
from twinrun.measures.kind import parse_device
from twinrun.measures.train_offload import OFFLOADS
from twinrun.measures.train_override import arm_train, check_override, validate_arm_settings
from twinrun.measures.train_state import validate_optimizer

# Where an intervention can act in training; one that overrides none of these acts nowhere.
TRAINING_HOOKS = ("sigma_cond", "attach", "train_lr", "loss_weight", "train_settings")
# Which floor an estimand is read against (train.floor_scope): its own or the model's, whichever sets the
# higher bar, or its own alone.
FLOOR_SCOPES = ("model", "estimand")
# Where the chaos arms' ulps land (train.chaos.weights): every weight, or one element of one.
CHAOS_WEIGHTS = ("every", "one")


def validate(cfg: DictConfig, intervention: Intervention) -> tuple:
    """The training settings, the intervention and the data, before any compute; each error names the
    key, the value and the fix. Returns the data ((train images, ids), (held-out images, ids))."""
    t = cfg.train
    for key in ("steps", "segment_steps", "batch_size", "heldout_images"):
        if not isinstance(t[key], int) or t[key] < 1:
            raise ConfigError(f"train.{key}", t[key], "must be a positive integer")
    if t.steps % t.segment_steps:
        raise ConfigError("train.segment_steps", t.segment_steps, f"must divide train.steps={t.steps} (every "
                          "segment is as long as the others); e.g. "
                          f"{max(d for d in range(1, t.segment_steps + 1) if t.steps % d == 0)}")
    if t.chunk_samples == 0 or t.chunk_samples < -1:
        raise ConfigError("train.chunk_samples", t.chunk_samples, "must be ≥ 1, or -1 for the whole batch")
    if not (math.isfinite(t.floor_margin) and t.floor_margin >= 1):
        raise ConfigError("train.floor_margin", t.floor_margin, "must be a finite factor ≥ 1 "
                          "(docs/training.md)")
    if t.floor_scope not in FLOOR_SCOPES:
        raise ConfigError("train.floor_scope", t.floor_scope, f"must be one of {', '.join(FLOOR_SCOPES)} "
                          "(docs/training.md)")
    if t.chaos.ulps == 0:
        raise ConfigError("train.chaos.ulps", t.chaos.ulps, "must be a nonzero number of ulps (the chaos arm "
                          "would be the twin); 1 is the default")
    if t.chaos.weights not in CHAOS_WEIGHTS:
        raise ConfigError("train.chaos.weights", t.chaos.weights,
                          f"must be one of {', '.join(CHAOS_WEIGHTS)} (docs/training.md)")
    if not isinstance(t.chaos.arms, int) or isinstance(t.chaos.arms, bool) or t.chaos.arms < 1:
        raise ConfigError("train.chaos.arms", t.chaos.arms, "must be a positive integer (2 is the default)")
    if t.chaos.weights == "one" and t.chaos.arms > 1:
        raise ConfigError("train.chaos.arms", t.chaos.arms, "with train.chaos.weights=one every chaos arm "
                          "would move the same element: use 1, or train.chaos.weights=every")
    if t.chaos.weights == "every":
        # param, index and the sign of ulps say where one element moves; under "every" each element's
        # direction is a seeded coin, so a value set there would be silently ignored
        default = ChaosConfig()
        for key in ("param", "index"):
            if getattr(t.chaos, key) != getattr(default, key):
                raise ConfigError(f"train.chaos.{key}", getattr(t.chaos, key), "places the one-element chaos "
                                  "arm: set train.chaos.weights=one (and train.chaos.arms=1) to use it; "
                                  "under weights=every each element moves by a seeded coin")
        if t.chaos.ulps < 0:
            raise ConfigError("train.chaos.ulps", t.chaos.ulps, "under train.chaos.weights=every each "
                              "element's direction is a seeded coin: give a positive number of ulps")
    optimizer = OmegaConf.to_container(t.optimizer, resolve=True) if t.optimizer is not None else None
    validate_optimizer(optimizer)
    loop.check_loop(t)
    if t.offload not in OFFLOADS:
        raise ConfigError("train.offload", t.offload, f"must be one of {', '.join(OFFLOADS)} "
                          "(docs/training.md)")
    _validate_device(t.device)
    check_replicate_segments(cfg)
    mode = trial.compile_mode(t.compile, "train.compile")
    trial.refuse_compiled_hooks(mode, {"intervention": intervention}, "train.compile")
    if cfg.reference is not None:
        raise ConfigError("reference", cfg.reference, "a training run takes no reference: compare two "
                          "training runs with `python -m twinrun.compare RUN_A RUN_B`")
    refuse_derived(cfg.reduce.estimands)
    check_override(cfg, intervention)
    check_training_intervention(intervention)
    train, held = split_data(build(OmegaConf.to_container(cfg.data, resolve=True), "data"))
    (train_x, train_ids, train_cond), (held_x, held_ids, held_cond) = train, held
    if t.batch_size * t.accumulate > train_x.shape[0]:
        raise ConfigError("train.batch_size", t.batch_size, f"the training split has only {train_x.shape[0]} "
                          f"images (a step draws its batch x train.accumulate={t.accumulate} without "
                          "replacement); use at most that")
    if t.heldout_images > held_x.shape[0]:
        raise ConfigError("train.heldout_images", t.heldout_images, f"the held-out split has only "
                          f"{held_x.shape[0]} images; use at most that")
    # The intervention arm's own settings (an override's), after the twin's: a twin's error names its key.
    validate_arm_settings(arm_train({"train": OmegaConf.to_container(t, resolve=True)}, intervention),
                          train_x.shape[0])
    for what, ids in (("training", train_ids), ("held-out", held_ids)):
        if len(set(ids)) != len(ids):
            raise ConfigError("data._target_", cfg.data.get("_target_"), f"the {what} ids repeat: an id keys "
                              "a sample's noise, so each must name one image")
    return (train_x, list(train_ids), train_cond), (held_x, list(held_ids), held_cond)


def check_replicate_segments(cfg: DictConfig) -> None:
    """arms.replicate_segments=K: a whole number of the run's segments, and only on a deterministic path,
    where a replicate that repeats the twin bit for bit for K segments is the evidence that it would go on
    doing so; with determinism off the replicates' spread is the gate's bound at every step."""
    k, n = cfg.arms.get("replicate_segments"), cfg.train.steps // cfg.train.segment_steps
    if k is None:
        return
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= n:
        raise ConfigError("arms.replicate_segments", k, f"must be a whole number of segments in 1 … {n}, or "
                          "null (the replicate in every segment, the default)")
    if not cfg.determinism.enabled:
        raise ConfigError("arms.replicate_segments", k, "needs determinism.enabled=true: with determinism "
                          "off the replicates bound the path's wobble at every step, so they are measured in "
                          "every segment; leave it null")


def split_data(data) -> tuple[tuple, tuple]:
    """((images, ids, cond), (images, ids, cond)) of the training builder's two splits, each given as
    (images, ids) or (images, ids, cond); each split's conditioning checked against its images."""
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise ConfigError("data._target_", type(data).__name__, "a training data builder returns (training "
                          "split, held-out split), each (images, ids) or (images, ids, cond)")
    out = tuple(conditioning.split(part) for part in data)
    for (x, _, cond), what in zip(out, ("training", "held-out")):
        conditioning.check(cond, x.shape[0], key=f"data._target_ ({what} split)")
    if set(out[0][2]) != set(out[1][2]):
        raise ConfigError("data._target_", sorted(set(out[0][2]) ^ set(out[1][2])), "the training and "
                          "held-out splits must carry the same conditioning entries")
    return out


def _validate_device(name: str) -> None:
    """The spelling only: whether the GPU exists is the job's to judge, on the node that trains (the
    host that plans a SLURM run may have none); a job that lacks it fails with exit 5 before any step."""
    parse_device("train.device", name)


def check_training_intervention(intervention: Intervention) -> None:
    """Refuse, before compute, an intervention a training run cannot vouch for: without a no-op setting
    there is no machinery arm, its only gate (no step of training is a no-op of an intervention the way
    a probe's σ bin can be); one that acts nowhere in training, or sits at its no-op setting, measures
    nothing."""
    key = f"intervention({type(intervention).__name__})"
    settings = {k: v for k, v in vars(intervention).items() if not k.startswith("_")}
    noop = intervention.noop()
    if noop is None:
        raise ConfigError(key, settings, "has no no-op setting (`noop()`): a training run's gate is the "
                          "machinery arm, the intervention's own code at its no-op setting, which must be "
                          "bit-identical to the twin at every step; without one nothing vouches for the "
                          "instrument. Declare a no-op setting, or train with an intervention that has one "
                          "(scale_lr: factor=1; weight_sigma: power=0)")
    if not acts_through(intervention, TRAINING_HOOKS):
        raise ConfigError(key, settings, f"acts nowhere in training (it overrides none of "
                          f"{', '.join(TRAINING_HOOKS)}): nothing to measure")
    if all(settings.get(k) == v for k, v in noop.items()):
        raise ConfigError(key, settings, f"is at its no-op setting {noop}: nothing to measure; choose "
                          "settings that change something")
    intervention.check_train()
