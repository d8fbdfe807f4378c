"""Twin derivation: only the intervention differs; anything else is refused."""

import pytest

from twinrun.arms import NotATwin, config_diff, derive_arms
from twinrun.errors import TwinrunError


def test_twin_is_the_same_config_with_a_native_intervention(compose_cfg):
    cfg = compose_cfg(["+experiment=pin_sigma", "seed=7"])
    arms, diff = derive_arms(cfg, "pin_sigma")
    mine, twin = arms[0].config, arms[1].config
    assert twin["intervention"] == {"_target_": "twinrun.interventions.Native"}
    assert twin["seed"] == mine["seed"] == 7
    assert {k: v for k, v in mine.items() if k != "intervention"} == {
        k: v for k, v in twin.items() if k != "intervention"}
    assert {d["key"] for d in diff} == {"intervention._target_", "intervention.sigma_pin"}


def test_replicate_arm_is_a_second_native_twin(compose_cfg):
    arms, _ = derive_arms(compose_cfg(["+experiment=pin_sigma"]), "pin_sigma", replicate=True)
    assert [a.name for a in arms] == ["pin_sigma", "native", "native_replicate"]
    assert arms[1].config == arms[2].config


def test_a_key_that_reads_the_intervention_makes_the_pair_not_a_twin(compose_cfg):
    # The grid interpolates σ_pin: the twin would see another grid (or none): refused.
    cfg = compose_cfg(["+experiment=pin_sigma", "sigma_grid.sigmas=[0.2,${intervention.sigma_pin}]"])
    with pytest.raises(NotATwin, match="must not depend on the intervention|differs outside"):
        derive_arms(cfg, "pin_sigma")


def test_a_native_intervention_arm_is_refused(compose_cfg):
    with pytest.raises(TwinrunError, match=r"\+experiment=pin_sigma"):
        derive_arms(compose_cfg([]), "native")


def test_config_diff_names_leaves():
    diff = config_diff({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"b": 1, "c": 5}, "d": 3, "e": 1})
    assert diff == [{"key": "a.c", "a": 2, "b": 5}, {"key": "e", "a": None, "b": 1}]
