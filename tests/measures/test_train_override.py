"""A config override as a training intervention (`intervention=override`): its machinery arm runs the same
mechanism with the twin's values and must be bit-identical to the twin at every step (a mechanism that
changes something at the twin's values fails the gate); an override of the batch size trains on a prefix
of the same keyed samples; keys that change what is measured are refused in one line, exit 2."""

import subprocess
import sys
import textwrap

import pytest
import torch
from hydra import compose, initialize_config_dir

from twinrun.analysis.train_reduce import reduce_train
from twinrun.app import CONF_DIR
from twinrun.config import register_configs
from twinrun.errors import ConfigError
from twinrun.interventions import Override
from twinrun.job import run_job
from twinrun.plan import plan_run, trusted_targets
from twinrun.storage.rundir import RunIndex
from twinrun.storage.train_store import read_train_store

TINY = ["train.steps=4", "train.segment_steps=2", "train.batch_size=16", "train.heldout_images=16"]


def cfg_of(overrides=()):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=["+experiment=train_override", *TINY, *overrides])


def train_run(run_dir, overrides):
    cfg = cfg_of(overrides)
    plan_run(cfg, run_dir)
    run_job(run_dir, trusted_targets(cfg))
    return reduce_train(run_dir)


def test_the_override_mechanism_sets_dotted_keys_and_replaces_whole_nodes():
    o = Override(set={"train.optimizer.weight_decay": 0.1, "train.batch_size": 8})
    twin = {"batch_size": 16, "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": 0.0}}
    mine = o.train_settings(twin)
    assert mine == {"batch_size": 8, "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-3,
                                                   "weight_decay": 0.1}}
    assert twin["optimizer"]["weight_decay"] == 0.0 and twin["batch_size"] == 16  # the twin's untouched
    sgd = Override(set={"train.optimizer": {"_target_": "torch.optim.SGD", "lr": 1e-2}}).train_settings(twin)
    assert sgd["optimizer"] == {"_target_": "torch.optim.SGD", "lr": 1e-2}  # replaced, never merged


def test_the_machinery_arm_sets_the_twins_own_values():
    cfg = cfg_of(["intervention.set={train.optimizer.weight_decay: 0.1, train.batch_size: 8}"])
    run = plan_run(cfg, None, dry_run=True)
    assert [a["role"] for a in run["arms"]] == ["intervention", "twin", "replicate", "machinery", "chaos",
                                               "chaos"]


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["{train.optimizer.weight_decay: 0.1}", "{train.batch_size: 8}"])
def test_an_override_trains_its_arm_and_its_machinery_arm_is_bit_identical_to_the_twin(tmp_path, setting):
    red = train_run(tmp_path / "run", [f"intervention.set={setting}"])
    s = red.summary
    assert s["passed"] and red.exit_code == 0
    assert all(g["passed"] and g["rule"].startswith("bit") for g in s["gates"]), s["gates"]
    first = {f["arm"]: f["step"] for f in s["first_differing"]}
    assert first["override"] == 1 and first["override_noop"] is None
    assert all(r["train_loss_own"] is not None for r in s["losses"] if r["step"])
    assert "twin's objective" in s["verdict"]
    index = RunIndex.load(tmp_path / "run")
    noop = read_train_store(index.store_path(index.units[-1], "override_noop"))
    twin = read_train_store(index.store_path(index.units[-1], "native"))
    assert noop.digests == twin.digests
    assert all(torch.equal(noop.tensors[k], twin.tensors[k]) for k in twin.tensors)


BROKEN = textwrap.dedent("""
    from twinrun.interventions import Override

    class LossyOverride(Override):
        '''Its mechanism rounds every number it sets by a relative 1e-7: at the twin's values too.'''
        def train_settings(self, train):
            out = super().train_settings(train)
            out["optimizer"] = dict(out["optimizer"], lr=out["optimizer"]["lr"] * (1 + 1e-7))
            return out
""")


@pytest.mark.slow
def test_a_mechanism_that_changes_something_at_the_twins_values_fails_the_gate(tmp_path, monkeypatch):
    (tmp_path / "lossy_override.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    red = train_run(tmp_path / "run", ["intervention._target_=lossy_override.LossyOverride",
                                       "intervention.set={train.optimizer.weight_decay: 0.1}"])
    failed = [g for g in red.summary["gates"] if not g["passed"]]
    assert failed and failed[0]["rule"] == "not a no-op on a deterministic path"
    assert red.exit_code == 1
    sys.modules.pop("lossy_override", None)


@pytest.mark.parametrize("setting,key", [
    ("{train.steps: 8}", "intervention.set[train.steps]"),
    ("{train.segment_steps: 1}", "intervention.set[train.segment_steps]"),
    ("{train.heldout_images: 8}", "intervention.set[train.heldout_images]"),
    ("{train.chaos.ulps: 2}", "intervention.set[train.chaos.ulps]"),
    ("{train.floor_scope: estimand}", "intervention.set[train.floor_scope]"),
    ("{train.start_checkpoint: x}", "intervention.set[train.start_checkpoint]"),
    ("{train.device: cpu}", "intervention.set[train.device]"),
    ("{seed: 3}", "intervention.set[seed]"),
    ("{data.name: x}", "intervention.set[data.name]"),
    ("{model.path: x}", "intervention.set[model.path]"),
    ("{probe.n_images: 3}", "intervention.set[probe.n_images]"),
    ("{train.optimizer.nesterov: true}", "intervention.set[train.optimizer.nesterov]"),
    ("{train.batch_size: 0}", "intervention.set[train.batch_size]"),
    ("{train.batch_size: 99999}", "intervention.set[train.batch_size]"),
    ("{train.optimizer.lr: -1}", "intervention.set[train.optimizer.lr]"),
    ("{train.optimizer.weight_decay: 0.0}", "intervention(Override)"),  # the twin's value: a no-op
    ("{}", "intervention.set"),
])
def test_a_key_an_override_may_not_set_is_one_line_naming_it_before_compute(tmp_path, setting, key):
    with pytest.raises(ConfigError) as err:
        plan_run(cfg_of([f"intervention.set={setting}"]), tmp_path / "run")
    assert str(err.value).startswith(f"{key}=") and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


def test_a_refused_key_exits_2_with_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "twinrun", "+experiment=train_override",
                           "intervention.set={train.steps: 8}", f"hydra.run.dir={tmp_path / 'run'}"],
                          check=False, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "intervention.set[train.steps]" in lines[0] and "refused" in lines[0]


def test_the_probe_refuses_an_override():
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=pin_sigma", "intervention=override",
                                                       "intervention.set={train.batch_size: 8}"])
    with pytest.raises(ConfigError, match="training intervention"):
        plan_run(cfg, None, dry_run=True)
