"""Twin sampling (measure=sample): the samplers (EDM's and the flow ODE) against a known solution, the MMD
estimator against the truth by simulation, noise keyed per sample, each sample conditioned on its own
image's conditioning in any chunking, an objective without a sampler refused, and end to end on the
default model: a resume that is bit-identical, a stochastic sampler whose replicate is bit-identical,
and a 1e-7 leak in the sampler's conditioning that fails its gate."""

import json
import math
import os
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cond_models import cond_data, tiny
from conftest import run_twinrun
from safetensors.torch import load

from twinrun import conditioning
from twinrun.analysis.sample_reduce import mmd2
from twinrun.errors import ConfigError
from twinrun.measures import samplers
from twinrun.measures.sample import SampleSession
from twinrun.plan import plan_run

SMALL = ["+experiment=sample_pin_sigma", "sample.n_samples=4", "sample.chunk_samples=2", "sample.steps=3",
         "sample.device=cpu"]
TESTS = Path(__file__).resolve().parents[1]  # tests/: the child imports cond_models from its cwd
# objective=vp on the tests' conditional model (it declares ᾱ; the default model is an EDM denoiser, which
# objective=vp refuses): the pin and the loss levels are its timesteps.
VP = ["objective=vp", "model._target_=cond_models.tiny", "data._target_=cond_models.cond_data",
      "intervention.sigma_pin=500", "sample.loss_sigmas=[100,500]"]


def gaussian_denoiser(s: float):
    """The exact D(x; σ) of data ~ N(0, s²): the probability-flow ODE then has the closed-form solution
    x(σ) = x(σ_0)·sqrt(s² + σ²)/sqrt(s² + σ_0²)."""
    return lambda x, sigma: x * (s**2 / (s**2 + sigma.reshape(-1, 1, 1, 1).double() ** 2)).float()


DETERMINISTIC = {"s_churn": 0.0, "s_tmin": 0.0, "s_tmax": 1e9, "s_noise": 1.0}


def _error(sampler: str, steps: int, s: float = 0.5) -> float:
    sigmas = samplers.edm_sigmas(steps, 0.002, 80.0, 7.0)
    noise = torch.randn(64, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    out = samplers.sample(gaussian_denoiser(s), noise, sigmas, sampler, DETERMINISTIC)
    truth = noise.double() * sigmas[0] * s / math.sqrt(s**2 + sigmas[0] ** 2)
    return float((out.double() - truth).abs().max() / truth.abs().max())


@pytest.mark.parametrize("sampler,order", [("euler", 1), ("heun", 2)])
def test_the_deterministic_samplers_converge_to_the_exact_ode_solution_at_their_order(sampler, order):
    # 4x the steps: Euler's error shrinks 4x (first order), Heun's 16x (second order).
    coarse, fine = _error(sampler, 32), _error(sampler, 128)
    assert fine < 0.03 and 0.6 * 4**order < coarse / fine < 1.6 * 4**order, (coarse, fine)


def test_the_stochastic_sampler_adds_noise_only_where_asked_and_only_keyed_noise():
    sigmas = samplers.edm_sigmas(6, 0.002, 80.0, 7.0)
    churn = {"s_churn": 10.0, "s_tmin": 0.05, "s_tmax": 50.0, "s_noise": 1.0}
    churned = [k for k, s in enumerate(sigmas[:-1]) if samplers.gamma_of(s, 6, 10.0, 0.05, 50.0) > 0]
    assert churned and len(churned) < 6  # σ_max = 80 lies above s_tmax: no noise added there
    asked = []

    def noise_at(k):
        asked.append(k)
        return samplers.step_noise(0, [0, 1], k, (1, 2, 2))

    noise = samplers.initial_noise(0, [0, 1], (1, 2, 2))
    a = samplers.sample(gaussian_denoiser(0.5), noise, sigmas, "heun", churn, noise_at)
    b = samplers.sample(gaussian_denoiser(0.5), noise, sigmas, "heun", churn, noise_at)
    assert asked == churned * 2 and torch.equal(a, b)


def test_a_samples_noise_is_keyed_by_its_index_not_by_its_chunk():
    whole = samplers.initial_noise(3, [0, 1, 2, 3], (1, 4, 4))
    assert torch.equal(samplers.initial_noise(3, [2, 3], (1, 4, 4)), whole[2:])
    assert torch.equal(samplers.step_noise(3, [1], 5, (1, 4, 4))[0],
                       samplers.step_noise(3, [0, 1], 5, (1, 4, 4))[1])
    assert not torch.equal(samplers.initial_noise(4, [0], (1, 4, 4))[0], whole[0])  # another seed
    assert not torch.equal(samplers.step_noise(3, [0], 0, (1, 4, 4))[0], whole[0])  # another stream


@pytest.mark.parametrize("shift,se_ratio", [(0.0, (1.0, 1.7)), (0.1, (1.0, 1.6)), (0.5, (0.9, 1.2))])
def test_the_mmd_estimate_is_unbiased_and_its_se_never_understates_its_spread(shift, se_ratio):
    # δ_i = φ(x_i) − φ(y_i) with mean μ: the U-statistic estimates |μ|² without the plug-in's bias |δ|²/n.
    # Its jackknife SE matches the estimates' spread where the effect dominates and is conservative near
    # none (the jackknife overstates a U-statistic's degenerate term): never too small.
    gen = torch.Generator().manual_seed(1)
    mu = torch.zeros(16)
    mu[:5] = shift
    found = [mmd2(mu + torch.randn(40, 16, generator=gen)) for _ in range(1500)]
    values = torch.tensor([u for u, _ in found])
    ses = torch.tensor([se for _, se in found])
    assert abs(float(values.mean()) - float(mu @ mu)) < 4 * float(values.std()) / math.sqrt(len(found))
    assert se_ratio[0] < float(ses.mean()) / float(values.std()) < se_ratio[1]


def flow_error(sampler: str, steps: int, mu: float = 0.7, s: float = 0.5) -> float:
    """The flow ODE's error on data ~ N(μ, s²) with the exact velocity E[ε − x | x_t]: x_t = (1−t)x + tε
    has variance V(t) = (1−t)²s² + t², v(x_t, t) = −μ + (t − (1−t)s²)/V·(x_t − (1−t)μ), and the ODE
    carries x(1) = ε to exactly μ + s·ε at t = 0."""
    def velocity(x, t):
        t = t.reshape(-1, 1, 1, 1).double()
        y = x.double() - (1 - t) * mu
        return (-mu + (t - (1 - t) * s**2) / ((1 - t) ** 2 * s**2 + t**2) * y).float()

    noise = torch.randn(64, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    out = samplers.integrate("flow", velocity, noise, samplers.levels("flow", steps, 0, 0, 0), sampler,
                             DETERMINISTIC)
    truth = mu + s * noise.double()
    return float((out.double() - truth).abs().max() / truth.abs().max())


@pytest.mark.parametrize("sampler,order", [("euler", 1), ("heun", 2)])
def test_the_flow_samplers_converge_to_the_exact_ode_solution_at_their_order(sampler, order):
    coarse, fine = flow_error(sampler, 16), flow_error(sampler, 64)
    assert fine < 0.03 and 0.6 * 4**order < coarse / fine < 1.6 * 4**order, (coarse, fine)


REFUSED = [(["objective=flow", "sample.s_churn=5", "sample.loss_sigmas=[0.5]"],
            "sample.s_churn=5.0: EDM's stochastic sampler needs objective=edm"),
           (["sample.eta=0.5"], "sample.eta=0.5: DDIM's stochastic sampler needs objective=vp")]
# The same refusals in process (planning, dry): vp's own settings, each one line naming its key.
REFUSED_VP = [(["sample.loss_sigmas=[0.5]"], "sample.loss_sigmas", "under vp timesteps e.g. [100,300,600]"),
              (["sample.eta=1"], "sample.eta", "sampler=euler (DDIM itself; not vp, heun)"),
              (["sample.s_churn=5"], "sample.s_churn", "sample.eta > 0 is DDIM's stochastic sampler"),
              (["sample.steps=1001"], "sample.steps", "the model's schedule has 1000 timesteps"),
              (["sample.loss_sigmas=[1000]"], "sample.loss_sigmas", "1000 timesteps"),
              (["intervention.sigma_pin=0.5"], "intervention(PinSigma)", "an integer ≥ 0 (objective=vp)")]


@pytest.mark.parametrize("overrides,key,said", REFUSED_VP)
def test_vp_sampling_settings_it_cannot_run_are_refused_before_compute(compose_cfg, overrides, key, said):
    cfg = compose_cfg([*SMALL, *VP, *overrides])
    with pytest.raises(ConfigError) as err:
        plan_run(cfg, None, dry_run=True)
    assert err.value.key == key and said in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("objective", [[], [v for v in VP if not v.startswith("intervention.")]])
def test_an_intervention_that_feeds_every_step_its_own_level_is_refused_as_a_no_op(compose_cfg, objective):
    # scale_cond at gamma=1 returns σ itself: its arm would be the twin and its machinery arm would never
    # run its code (it returns before the scaling): a run of it would measure nothing and vouch for nothing.
    anchor = "intervention.anchor_sigma=500" if objective else "intervention.anchor_sigma=0.5"
    cfg = compose_cfg([*SMALL, *objective, "intervention=scale_cond", anchor, "intervention.gamma=1"])
    with pytest.raises(ConfigError, match="a no-op everywhere") as err:
        plan_run(cfg, None, dry_run=True)
    assert err.value.key == "intervention(ScaleCond)" and "\n" not in str(err.value)
    if not objective:  # under edm any other gamma scales (under vp it feeds no timestep: refused as such)
        plan_run(compose_cfg([*SMALL, "intervention=scale_cond", anchor, "intervention.gamma=0.5"]), None,
                 dry_run=True)


@pytest.mark.parametrize("overrides,said", REFUSED)
def test_a_sampler_the_objective_lacks_is_one_line_exit_2_before_compute(tmp_path, overrides, said):
    proc = run_twinrun([*SMALL, *overrides, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run" / "arms").exists()


def _cond_session(objective: dict, loss_levels: list, n_images: int = 3) -> SampleSession:
    config = {"seed": 5, "determinism": {}, "model": {"_target_": "cond_models.tiny"},
              "data": {"_target_": "cond_models.cond_data", "n": n_images}, "objective": objective,
              "sample": {"n_samples": 8, "chunk_samples": 4, "steps": 4, "sigma_max": 5.0,
                         "loss_sigmas": loss_levels}}
    native = {"_target_": "twinrun.interventions.Native"}
    arm = SimpleNamespace(name="native", config={"intervention": native})
    return SampleSession(config, [arm], torch.device("cpu"))


def _sample_unit(session: SampleSession, first: int, count: int) -> dict:
    u = {"index": 0, "label": "chunk", "sample": {"first": first, "count": count}}
    session.begin_unit(u)
    tensors, _ = session.measure(u, "native", {"config_hash": "", "env": {}, "kernel_path": ""})
    return tensors


@pytest.mark.parametrize("objective,levels", [({"_target_": "twinrun.objectives.EDM"}, [0.5, 2.0]),
                                              ({"_target_": "twinrun.objectives.Flow"}, [0.3, 0.7])])
def test_a_chunk_samples_each_sample_with_its_own_images_conditioning(objective, levels):
    session = _cond_session(objective, levels)
    chunk = _sample_unit(session, 2, 4)  # samples 2..5 of 3 images: conditioning rows 2, 0, 1, 2
    _, _, cond = cond_data(3)
    model = tiny()
    for k, i in enumerate(range(2, 6)):
        alone = _sample_unit(session, i, 1)
        for name in ("samples", "loss", "features"):
            assert torch.allclose(chunk[name][k], alone[name][0], rtol=1e-5, atol=1e-6), (name, i)
        # ... and it is the sampler run by hand on image i mod 3's conditioning
        own = conditioning.take(cond, [i % 3])
        def by_hand_model(x, lev, own=own):
            return model(x, lev, lev, **own)
        by_hand = samplers.integrate(session.objective.name, by_hand_model,
                                     samplers.initial_noise(5, [i], (1, 8, 8)), session.sigmas, "heun",
                                     {"s_churn": 0.0, "s_tmin": 0.0, "s_tmax": 1e9, "s_noise": 1.0})
        assert torch.allclose(chunk["samples"][k], by_hand[0], rtol=1e-5, atol=1e-6), i
    assert not torch.allclose(chunk["samples"][0], chunk["samples"][3])  # one row, other noise
    # the conditioning is part of what was sampled: other embeddings, another data digest
    other = _cond_session(objective, levels, n_images=4)
    assert other.identity["data_sha256"] != session.identity["data_sha256"]


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
def test_twin_sampling_runs_end_to_end_and_resumes_bit_identically(tmp_path):
    run = tmp_path / "run"
    proc = run_twinrun([*SMALL, f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = _summary(run)
    assert summary["passed"] and summary["replicate"]["bit_identical"] and not summary["no_machinery_arm"]
    # pin_sigma's machinery arm (the pin following each step's σ) is the twin bit for bit in every chunk
    assert len(summary["gates"]) == 2 and all(g["bit_identical"] for g in summary["gates"]), summary["gates"]
    overall = {(r["role"], r["estimand"]): r for r in summary["overall"]}
    assert overall["replicate", "distance"]["value"] == 0.0 and overall["replicate", "mmd"]["value"] == 0.0
    assert overall["intervention", "distance"]["value"] > 0  # pinning σ_cond changes every sample
    assert "over all 4 samples" in proc.stdout
    # A kill after the first chunk, replayed: the second chunk's stores gone, run.json says pending.
    first = {p.name: p.read_bytes() for p in (run / "arms" / "native").glob("*.safetensors")}
    doc = json.loads((run / "run.json").read_text())
    for arm, entry in doc["units"][1]["stores"].items():
        (run / "arms" / arm / entry["file"]).unlink()
        entry.update(status="pending", sha256=None)
    doc["status"] = "interrupted"
    (run / "run.json").write_text(json.dumps(doc))
    proc = run_twinrun(["--local", str(run)], cwd=tmp_path, module="twinrun.resume")
    assert proc.returncode == 0, proc.stderr[-2000:]
    again = {p.name: p.read_bytes() for p in (run / "arms" / "native").glob("*.safetensors")}
    assert again.keys() == first.keys()
    # the tensors of the resumed chunk equal the first run's (its env record names the new job)
    for name, data in first.items():
        a, b = load(data), load(again[name])
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert _summary(run)["overall"] == summary["overall"]
    # compare refuses a kind that cannot be compared there, in one line naming what to use instead
    refused = run_twinrun([str(run), str(run / "arms" / "pin_sigma")], cwd=tmp_path, module="twinrun.compare")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "python -m twinrun.table A B" in refused.stderr and "Traceback" not in refused.stderr
    # Held to the one reader standard (analysis/vouch.py): an arm's config.yaml edited by hand is one
    # line naming it, exit 2, never a reading.
    config = run / "arms" / "pin_sigma" / "config.yaml"
    config.write_text(config.read_text().replace("seed: 0", "seed: 1"))
    edited = run_twinrun([str(run)], cwd=tmp_path, module="twinrun.reduce")
    assert edited.returncode == 2 and len(edited.stderr.strip().splitlines()) == 1, edited.stderr
    assert "config.yaml" in edited.stderr and "Traceback" not in edited.stderr


LEAKY = textwrap.dedent("""
    from dataclasses import dataclass
    from typing import ClassVar

    import torch

    from twinrun.interventions import PinSigma

    LEAK = 1e-7

    @dataclass
    class LeakyPin(PinSigma):
        # pin_sigma whose pin, at its machinery setting (sigma_pin = 0: follow each step's σ), fills the
        # conditioning with σ·(1 + LEAK): a leak of 1e-7 in the sampler's conditioning, nowhere else.
        name: ClassVar[str] = "leaky_pin"

        def pinned(self, sigma):
            level = super().pinned(sigma)
            return level * (1 + LEAK) if self.sigma_pin == 0 else level
""")


@pytest.mark.slow
def test_a_leak_of_1e_7_in_the_samplers_conditioning_fails_its_gate(tmp_path):
    # (with LEAK = 0 the same run passes: its machinery arm is then pin_sigma's own, bit-identical). Under
    # vp the tests' model reads the timestep through log1p, where 1e-7 of t ~ 500 is below float32's
    # resolution: there a leak that small does not reach the samples, so this reads EDM's sampler.
    (tmp_path / "user_sampling.py").write_text(LEAKY)
    run = tmp_path / "run"
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = run_twinrun([*SMALL, "sample.s_churn=10", "intervention._target_=user_sampling.LeakyPin",
                        f"hydra.run.dir={run}"], cwd=tmp_path, env=env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = _summary(run)
    assert summary["checks_passed"] and not summary["passed"] and summary["overall"] == []
    assert summary["replicate"]["bit_identical"]  # the stochastic sampler repeats bit for bit
    assert {g["rule"] for g in summary["gates"]} == {"not a no-op on a deterministic path"}
    assert "instrument broken" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("sampler", [["sample.sampler=heun"], ["sample.sampler=euler", "sample.eta=1"]])
def test_vp_sampling_runs_end_to_end_with_bit_identical_gates(tmp_path, sampler):
    # DDIM with Heun's correction, then DDIM at η = 1 (its stochastic variant), on the model's timesteps:
    # the replicate and pin_sigma's machinery arm are the twin bit for bit, the pin changes every sample.
    run = tmp_path / "run"
    proc = run_twinrun([*SMALL, *VP, *sampler, f"hydra.run.dir={run}"], cwd=TESTS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = _summary(run)
    assert summary["passed"] and summary["replicate"]["bit_identical"] and not summary["no_machinery_arm"]
    assert len(summary["gates"]) == 2 and all(g["bit_identical"] for g in summary["gates"]), summary["gates"]
    overall = {(r["role"], r["estimand"]): r for r in summary["overall"]}
    assert overall["replicate", "distance"]["value"] == 0.0
    assert overall["intervention", "distance"]["value"] > 0


@pytest.mark.slow
@pytest.mark.trackers
def test_a_sampling_run_reaches_status_the_table_and_a_tracker_as_every_kind_does(tmp_path):
    # The kind-neutral rooms read a sampling run through the kind's own fields: status counts its chunks,
    # the table has a row per chunk and estimand, and TensorBoard holds each arm's estimates per chunk.
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run = tmp_path / "run"
    proc = run_twinrun([*SMALL, "tracker=tensorboard", f"tracker.dir={tmp_path / 'tb'}",
                        f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    status = run_twinrun([str(run)], cwd=tmp_path, module="twinrun.status")
    assert status.returncode == 0 and "pin_sigma 2/2" in status.stdout, status.stdout + status.stderr
    assert "gates passed" in status.stdout, status.stdout
    table = run_twinrun([str(run), "--csv", str(tmp_path / "t.csv")], cwd=tmp_path, module="twinrun.table")
    assert table.returncode == 0, table.stderr
    rows = (tmp_path / "t.csv").read_text().splitlines()
    header = rows[0].split(",")
    kinds = {r.split(",")[header.index("measure")] for r in rows[1:]}
    estimands = {r.split(",")[header.index("estimand")] for r in rows[1:]}
    assert kinds == {"sample"} and {"distance", "loss", "mmd"} <= estimands, rows[:3]
    events = list((tmp_path / "tb").rglob("pin_sigma/events.out.tfevents.*"))
    assert len(events) == 1, list((tmp_path / "tb").rglob("*"))
    reader = event_accumulator.EventAccumulator(str(events[0]))
    reader.Reload()
    assert {"distance", "mmd", "loss"} <= set(reader.Tags()["scalars"])
    assert [e.step for e in reader.Scalars("distance")] == [0, 1]  # one point per chunk
