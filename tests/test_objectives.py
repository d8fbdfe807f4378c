"""Each objective's formulas against hand-written ones, `edm` as the arithmetic twinrun always ran, and the
probe under objective=vp end to end (its grid and pin in the model's timesteps: sigma_grid=vp6)."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_twinrun

from twinrun.errors import ConfigError
from twinrun.instantiate import objective_of as from_config
from twinrun.measures import train_step as ts
from twinrun.model import DiTDenoiser
from twinrun.objectives import EDM, OBJECTIVES, VP, Flow, Objective
from twinrun.plan import plan_run


class Schedule:
    sigma_data = 0.5
    alphas_cumprod = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0)


X = torch.randn(5, 1, 4, 4, generator=torch.Generator().manual_seed(0))
EPS = torch.randn(5, 1, 4, 4, generator=torch.Generator().manual_seed(1))


def test_edm_by_hand():
    sigma = torch.tensor([0.1, 0.5, 1.0, 2.0, 80.0])
    m = Schedule()
    for i, s in enumerate(sigma.tolist()):
        assert torch.equal(EDM().noisy(m, X, EPS, sigma)[i], X[i] + s * EPS[i])
        lam = (s**2 + 0.25) / (s * 0.5) ** 2
        assert EDM().weight(m, sigma)[i].item() == pytest.approx(lam, rel=1e-6)
    assert EDM().target(m, X, EPS, sigma) is X
    normal = torch.tensor([-1.0, 0.0, 2.0])
    assert torch.allclose(EDM().train_level(m, normal), torch.exp(-1.2 + 1.2 * normal))


def test_flow_by_hand():
    t = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9])
    m = Schedule()
    for i, ti in enumerate(t.tolist()):
        assert torch.allclose(Flow().noisy(m, X, EPS, t)[i], (1 - ti) * X[i] + ti * EPS[i])
    assert torch.equal(Flow().target(m, X, EPS, t), EPS - X)
    assert torch.equal(Flow().weight(m, t), torch.ones(5))
    normal = torch.tensor([-3.0, 0.0, 1.0])
    assert torch.allclose(Flow().train_level(m, normal), 1 / (1 + torch.exp(-normal)))
    assert torch.allclose(Flow(logit_mean=0.5, logit_std=2.0).train_level(m, normal),
                          1 / (1 + torch.exp(-(0.5 + 2 * normal))))


def test_vp_by_hand():
    m = Schedule()
    t = torch.tensor([0.0, 10.0, 250.0, 500.0, 999.0])
    for i, ti in enumerate(t.tolist()):
        abar = float(torch.prod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)[: int(ti) + 1]))
        want = math.sqrt(abar) * X[i] + math.sqrt(1 - abar) * EPS[i]
        assert torch.allclose(VP().noisy(m, X, EPS, t)[i], want, atol=1e-5)
    assert torch.equal(VP().target(m, X, EPS, t), EPS)
    # Uniform timesteps: the normal CDF of the draw times T, floored, inside 0..T-1.
    levels = VP().train_level(m, torch.tensor([-10.0, 0.0, 10.0]))
    assert levels.tolist() == [0.0, 500.0, 999.0]


def test_per_sample_loss_is_weight_times_mean_square():
    m = Schedule()
    out = torch.randn_like(X)
    for obj, level in ((EDM(), torch.full((5,), 0.7)), (Flow(), torch.full((5,), 0.3)),
                       (VP(), torch.full((5,), 300.0))):
        lam = obj.weight(m, level)
        want = lam * ((out - obj.target(m, X, EPS, level)) ** 2).flatten(1).mean(1)
        assert torch.allclose(obj.per_sample_loss(m, out, X, EPS, level), want)


def test_edm_training_loss_is_the_old_arithmetic_bit_for_bit():
    torch.manual_seed(0)
    model = DiTDenoiser(img_resolution=4, width=16, depth=1, heads=2)
    x, eps = torch.randn(6, 1, 4, 4), torch.randn(6, 1, 4, 4)
    sigma = ts.sigma_of(torch.randn(6))
    with torch.no_grad():  # the loss as train_step.py wrote it before objectives
        sigma_img = sigma.reshape(6, 1, 1, 1)
        denoised = model(x + sigma_img * eps, sigma, sigma)
        lam = (sigma_img**2 + model.sigma_data**2) / (sigma_img * model.sigma_data) ** 2
        old = (lam * (denoised - x) ** 2).flatten(1).mean(1)
        new = ts.per_sample_loss(model, x, sigma, eps, sigma, EDM())
    assert torch.equal(old, new)
    assert torch.equal(EDM().train_level(model, torch.tensor([0.3])), ts.sigma_of(torch.tensor([0.3])))


@pytest.mark.parametrize(("obj", "levels", "bad"), [
    (EDM(), [0.0, 1.0], "positive"), (Flow(), [0.5, 1.0], "(0, 1)"), (VP(), [10.5], "integer"),
    (VP(), [1000], "1000 timesteps")])
def test_levels_an_objective_cannot_take_are_one_line_naming_the_key(obj, levels, bad):
    with pytest.raises(ConfigError) as err:
        obj.check("sigma_grid.sigmas", levels, Schedule())
    assert "sigma_grid.sigmas" in str(err.value) and bad in str(err.value)


def test_a_model_without_what_the_objective_reads_is_refused():
    with pytest.raises(ConfigError, match="alphas_cumprod"):
        VP().check_model(torch.nn.Linear(1, 1))
    with pytest.raises(ConfigError, match="sigma_data"):
        EDM().check_model(torch.nn.Linear(1, 1))


def test_from_config_builds_each_and_your_own():
    assert isinstance(from_config(None), EDM)  # a run recorded before objectives: edm, which it ran
    for name, cls in OBJECTIVES.items():
        assert type(from_config({"_target_": f"twinrun.objectives.{cls.__name__}"})) is cls, name
    own = from_config({"_target_": "test_objectives.Scaled", "factor": 3.0})
    assert isinstance(own, Objective) and own.factor == 3.0
    with pytest.raises(ConfigError, match="not an objective"):
        from_config({"_target_": "torch.nn.Identity"})


class Scaled(EDM):
    """A user's own objective: EDM with its weight scaled (a dataclass field via __init__)."""

    def __init__(self, factor: float = 1.0):
        super().__init__()
        self.factor = factor

    def weight(self, model, level):
        return self.factor * super().weight(model, level)


TESTS = Path(__file__).resolve().parent
# The tests' conditional model declares ᾱ (the default model is an EDM denoiser: objective=vp refuses it).
VP_MODEL = ["objective=vp", "model._target_=cond_models.tiny", "data._target_=cond_models.cond_data"]
SMALL = TINY[:3]  # TINY's images, draws and folds; the grid is the experiment's (edm6) or vp6


def test_pin_sigma_under_vp_on_the_edm_grid_names_the_vp_grid(compose_cfg):
    with pytest.raises(ConfigError) as err:
        plan_run(compose_cfg(["+experiment=pin_sigma", *VP_MODEL, *SMALL]), None, dry_run=True)
    assert err.value.key == "sigma_grid.sigmas" and "e.g. sigma_grid=vp6" in str(err.value)


@pytest.mark.slow
def test_the_probe_runs_pin_sigma_under_vp_end_to_end_with_a_bit_identical_gate(tmp_path):
    run = tmp_path / "run"
    proc = run_twinrun(["+experiment=pin_sigma", *VP_MODEL, "sigma_grid=vp6", "intervention.sigma_pin=500",
                        *SMALL, f"hydra.run.dir={run}"], cwd=TESTS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["checks_passed"] and summary["passed"], summary["checks"]
    assert {g["sigma"] for g in summary["gates"]} == {500.0}  # the pin's bin, one gate per estimand
    assert all(g["bit_identical"] for g in summary["gates"])
    units = json.loads((run / "run.json").read_text())["units"]
    assert [u["probe"]["sigma"] for u in units] == [50.0, 150.0, 300.0, 500.0, 700.0, 900.0]  # vp6
