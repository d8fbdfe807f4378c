"""Tiny training runs for the tests that need one (measures/, untrusted/): the real conf/ composed as
`python -m twinrun` would, planned, trained and reduced in this process."""

from hydra import compose, initialize_config_dir

from twinrun.analysis.train_reduce import reduce_train
from twinrun.app import CONF_DIR
from twinrun.config import register_configs
from twinrun.job import run_job
from twinrun.plan import plan_run, trusted_targets

# 3 units (start + 2 segments of 2 steps), small batches: a few seconds end to end.
TINY = ["train.steps=4", "train.segment_steps=2", "train.batch_size=16", "train.heldout_images=16"]


def tiny_cfg(overrides=(), experiment="train_scale_lr"):
    return compose_cfg([f"+experiment={experiment}", *TINY, *overrides])


def train_run(run_dir, overrides=(), experiment="train_scale_lr"):
    """Plan, train and reduce a tiny training run in this process; its Reduction."""
    cfg = tiny_cfg(overrides, experiment)
    plan_run(cfg, run_dir)
    run_job(run_dir, trusted_targets(cfg))
    return reduce_train(run_dir)


def compose_cfg(overrides=()):
    """The real conf/ composed with overrides, as `python -m twinrun` would (any scope)."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))
