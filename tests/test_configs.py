"""Every experiment composes and builds; typos fail the way Hydra users expect."""

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError

from twinrun.app import CONF_DIR
from twinrun.arms import derive_arms
from twinrun.instantiate import build
from twinrun.measures.train_override import check_override

EXPERIMENTS = sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))
# What an experiment needs on the command line (an override's keys have no default).
GIVEN = {"train_override": ["intervention.set={train.optimizer.weight_decay: 0.1}"]}


def test_there_are_experiments():
    assert "pin_sigma" in EXPERIMENTS


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_builds(compose_cfg, name):
    cfg = compose_cfg([f"+experiment={name}", *GIVEN.get(name, [])])
    intervention = build(OmegaConf.to_container(cfg.intervention, resolve=True), "intervention")
    grid = list(cfg.sigma_grid.sigmas)
    if cfg.measure == "train":  # a training intervention's checks (an override learns the twin's values)
        intervention.check_train()
        check_override(cfg, intervention)
    else:
        intervention.check(grid)
    noop = intervention.noop()
    assert intervention.gate_sigmas(grid) or noop is not None, ("every experiment needs a gate bin "
                                                                "or a no-op setting")
    arms, diff = derive_arms(cfg, intervention.name, noop=noop)
    assert [a.role for a in arms] == ["intervention", "twin"] + (["machinery"] if noop is not None else [])
    assert diff and all(d["key"].startswith("intervention.") for d in diff)


def test_pin_sigma_default_lies_in_the_default_grid(compose_cfg):
    cfg = compose_cfg(["+experiment=pin_sigma"])
    assert cfg.intervention.sigma_pin in list(cfg.sigma_grid.sigmas)


def test_overrides_work_as_hydra_users_expect(compose_cfg):
    cfg = compose_cfg(["+experiment=pin_sigma", "intervention.sigma_pin=1.2", "probe.n_images=8"])
    assert cfg.intervention.sigma_pin == 1.2 and cfg.probe.n_images == 8


def test_typo_in_a_key_fails_naming_it(compose_cfg):
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg(["+experiment=pin_sigma", "probe.n_imgaes=8"])
    cause = err.value.__cause__
    assert isinstance(cause, ConfigAttributeError) and "Key 'n_imgaes' not in 'ProbeConfig'" in str(cause)


def test_typo_in_an_intervention_key_fails(compose_cfg):
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg(["+experiment=pin_sigma", "intervention.sigma_pn=1.0"])
    assert "sigma_pn" in str(err.value.__cause__)


def test_wrong_type_fails(compose_cfg):
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg(["+experiment=pin_sigma", "probe.n_draws=many"])
    assert "n_draws" in str(err.value.__cause__) or "n_draws" in str(err.value)
