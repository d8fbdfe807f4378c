"""What a real loop has (twinrun/measures/train_loop.py): schedules, clipping, accumulation, bf16 autocast,
fp16 with a grad scaler, EMA, and a step of your own; each checked against what it must compute, and a
resume that restores the scheduler's, the EMA's and the scaler's state bit for bit (a resume that forgets
any is caught)."""

import json
import math

import pytest
import torch
from hydra import compose, initialize_config_dir

from twinrun.app import CONF_DIR
from twinrun.config import TrainConfig, register_configs
from twinrun.errors import ConfigError
from twinrun.interventions import Native
from twinrun.job import run_job
from twinrun.measures import train_loop as loop
from twinrun.measures.train_state import ArmState
from twinrun.measures.train_streams import SampleNoise
from twinrun.plan import plan_run, trusted_targets
from twinrun.storage.rundir import RunIndex
from twinrun.storage.train_store import read_train_store


class Tiny(torch.nn.Module):
    """A denoiser-shaped linear model (forward(x, σ, σ_cond), sigma_data), optionally with BatchNorm."""

    sigma_data = 0.5

    def __init__(self, batchnorm: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 6)
        self.norm = torch.nn.BatchNorm1d(6) if batchnorm else torch.nn.Identity()

    def forward(self, x, sigma, sigma_cond):
        return self.norm(self.lin(x))


def arm_of(model, **settings) -> ArmState:
    lr = settings.pop("lr", 0.1)
    t = TrainConfig(**{"batch_size": 8, **settings})
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return ArmState(model, opt, Native(), 0, t, loop.build_schedule(t.schedule, opt),
                    loop.build_ema(t.ema, model), loop.build_step(t.step),
                    scaler=loop.build_scaler(t, torch.device("cpu")))


def batch(n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.rand(n, generator=g) + 0.2, torch.randn(n, 6, generator=g)


def step(arm, n=None):
    x, sigma, eps = batch(n or loop.step_samples(arm.t))
    return loop.loop_step(arm, arm.step_fn, x, list(range(x.shape[0])), sigma, eps, 7, 1)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ----------------------------------------------------------------------------- schedules


def test_warmup_cosine_and_linear_follow_their_formulas():
    f = loop.WarmupCosine(warmup_steps=4, total_steps=20, end=0.1)
    assert [f(s) for s in range(4)] == [0.2, 0.4, 0.6, 0.8] and f(4) == 1.0
    assert f(12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(20) == pytest.approx(0.1) and f(99) == pytest.approx(0.1)
    g = loop.Linear(warmup_steps=0, total_steps=10, end=0.0)
    assert [g(s) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]


def test_a_schedule_sets_the_rate_each_step_and_constant_builds_no_scheduler():
    model = Tiny()
    arm = arm_of(model, schedule={"_target_": "twinrun.measures.train_loop.warmup_cosine", "warmup_steps": 2,
                                  "total_steps": 6})
    seen = []
    for _ in range(6):
        seen.append(arm.optimizer.param_groups[0]["lr"])
        step(arm)
    expect = [0.1 * loop.WarmupCosine(2, 6)(s) for s in range(6)]
    assert seen == pytest.approx(expect, rel=1e-12)
    any_torch = arm_of(Tiny(), schedule={"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 2,
                                         "gamma": 0.5})
    for _ in range(4):
        step(any_torch)
    assert any_torch.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    assert arm_of(Tiny(), schedule={"_target_": None}).scheduler is None


def test_a_scheduler_that_cannot_be_built_is_one_line():
    with pytest.raises(ConfigError, match=r"^train.schedule._target_='torch.optim.lr_scheduler.Nope'"):
        loop.build_schedule({"_target_": "torch.optim.lr_scheduler.Nope"},
                            torch.optim.SGD(Tiny().parameters()))


# ----------------------------------------------------------------------------- clipping, accumulation, AMP


def test_clipping_bounds_the_gradient_norm_of_each_update():
    arm = arm_of(Tiny(), clip_norm=1e-3, lr=1.0)
    before = flat(arm.model)
    step(arm)
    assert (flat(arm.model) - before).norm().item() == pytest.approx(1e-3, rel=1e-4)  # SGD, lr 1: Δ = −g


def test_accumulating_micro_batches_is_one_update_over_all_their_samples():
    # Without batch statistics: two micro-batches of 8 are the batch of 16, up to the order of the sums.
    one, two = arm_of(Tiny(), batch_size=16), arm_of(Tiny(), batch_size=8, accumulate=2)
    assert loop.step_samples(two.t) == 16
    step(one), step(two)
    assert torch.allclose(flat(one.model), flat(two.model), atol=1e-6)
    assert not torch.equal(flat(one.model), flat(arm_of(Tiny(), batch_size=16).model))  # (it trained)


def test_with_batchnorm_accumulation_and_chunking_change_what_is_computed():
    # BatchNorm in train mode normalises over each forward's samples: micro-batches and chunks are
    # measured settings there, not a summation order.
    one = arm_of(Tiny(batchnorm=True), batch_size=16)
    two = arm_of(Tiny(batchnorm=True), batch_size=8, accumulate=2)
    chunked = arm_of(Tiny(batchnorm=True), batch_size=16, chunk_samples=4)
    step(one), step(two), step(chunked)
    assert (flat(one.model) - flat(two.model)).abs().max() > 1e-4
    assert (flat(one.model) - flat(chunked.model)).abs().max() > 1e-4


def test_bf16_autocast_runs_on_the_cpu_changes_the_arithmetic_and_repeats_bit_for_bit():
    plain, amp, again = arm_of(Tiny()), arm_of(Tiny(), amp="bf16"), arm_of(Tiny(), amp="bf16")
    step(plain), step(amp), step(again)
    assert torch.equal(flat(amp.model), flat(again.model))
    assert not torch.equal(flat(plain.model), flat(amp.model))
    with pytest.raises(ConfigError, match=r"^train.amp='fp8'"):
        loop.check_loop(TrainConfig(amp="fp8"))


def test_fp16_autocast_scales_the_loss_on_the_cpu_and_the_scalers_state_round_trips_bit_for_bit():
    plain, amp, again = arm_of(Tiny()), arm_of(Tiny(), amp="fp16"), arm_of(Tiny(), amp="fp16")
    step(plain), step(amp), step(again)
    assert plain.scaler is None and isinstance(amp.scaler, torch.amp.GradScaler)
    assert torch.equal(flat(amp.model), flat(again.model))
    assert not torch.equal(flat(plain.model), flat(amp.model))
    # This model's first three steps overflow in fp16 at the scaler's first scales: each is skipped and
    # the scale halved, so the scaler's state decides what later steps do. Six steps straight, against
    # three, a store's record, a fresh arm and three more.
    whole, first = arm_of(Tiny(), amp="fp16"), arm_of(Tiny(), amp="fp16")
    for _ in range(6):
        step(whole)
    for _ in range(3):
        step(first)
    record = json.loads(json.dumps(loop.scaler_record(first.scaler)))  # as a store's metadata holds it
    assert record["scale"] < 65536.0  # it backed off
    for restore in (True, False):  # False: break it, a resume that forgets the scaler's state
        then = arm_of(Tiny(), amp="fp16")
        then.model.load_state_dict(first.model.state_dict())
        if restore:
            loop.restore_scaler(then.scaler, record)
        for _ in range(3):
            step(then)
        assert torch.equal(flat(then.model), flat(whole.model)) == restore
        assert (loop.scaler_record(then.scaler) == loop.scaler_record(whole.scaler)) == restore
    with pytest.raises(ValueError, match="no grad scaler state"):
        loop.restore_scaler(then.scaler, None)


# ----------------------------------------------------------------------------- EMA


def test_the_ema_starts_at_the_start_weights_and_follows_its_recurrence():
    arm = arm_of(Tiny(), ema=0.9)
    start = flat(arm.model).double()
    assert torch.equal(torch.cat([t.reshape(-1) for t in arm.ema.shadow.values()]), flat(arm.model))
    expect = start.clone()
    for _ in range(3):
        step(arm)
        expect = expect + 0.1 * (flat(arm.model).double() - expect)
    got = torch.cat([t.reshape(-1) for t in arm.ema.shadow.values()]).double()
    assert torch.allclose(got, expect, atol=1e-6) and not torch.allclose(got, flat(arm.model).double())


# ----------------------------------------------------------------------------- your own step


def min_snr_step(model, batch, noise, step, gamma=5.0):
    """A user step: min-SNR-γ weighting and a random conditioning drop, its randomness from `noise`."""
    x, sigma = batch["x"], batch["sigma"]
    n = x + sigma[:, None] * batch["eps"]
    drop = noise.uniform() < 0.1
    cond = torch.where(drop, torch.full_like(sigma, 80.0), batch["sigma_cond"])
    snr = (model.sigma_data / sigma) ** 2
    return torch.clamp(snr, max=gamma) / snr * ((model(n, sigma, cond) - x) ** 2).mean(1)


def test_your_own_step_trains_and_its_draws_do_not_depend_on_chunking():
    whole = arm_of(Tiny(), batch_size=16, step={"_target_": f"{__name__}.min_snr_step", "gamma": 2.0})
    cut = arm_of(Tiny(), batch_size=16, chunk_samples=4,
                 step={"_target_": f"{__name__}.min_snr_step", "gamma": 2.0})
    step(whole), step(cut)
    assert torch.allclose(flat(whole.model), flat(cut.model), atol=1e-6)
    a = SampleNoise(3, 5, [10, 11, 12], torch.device("cpu")).normal(2)
    b = SampleNoise(3, 5, [12], torch.device("cpu")).normal(2)
    assert torch.equal(a[2], b[0]) and not torch.equal(a[0], a[1])


def test_a_step_returning_the_mean_is_refused_in_one_line():
    arm = arm_of(Tiny(), step={"_target_": "torch.mean"})
    arm.step_fn = lambda model, batch, noise, step: ((model(batch["x"], None, None) - batch["x"]) ** 2).mean()
    with pytest.raises(ConfigError, match="per-sample losses"):
        step(arm)


# ----------------------------------------------------------------------------- resume


LOOP = ["+experiment=train_scale_lr", "train.steps=4", "train.segment_steps=2", "train.batch_size=8",
        "train.heldout_images=8", "train/schedule=warmup_cosine", "train.schedule.warmup_steps=1",
        "train.clip_norm=0.5", "train.accumulate=2", "train.amp=bf16", "train.ema=0.9", "train.device=cpu"]


def loop_run(run_dir, interrupt: bool, amp: str = "bf16"):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*LOOP, f"train.amp={amp}"])
    plan_run(cfg, run_dir)
    run_job(run_dir, trusted_targets(cfg))
    if interrupt:  # forget the last segment; the job restores every arm from the first one's stores
        run = json.loads((run_dir / "run.json").read_text())
        for entry in run["units"][2]["stores"].values():
            entry.update(status="pending", sha256=None)
        (run_dir / "run.json").write_text(json.dumps(run))
        run_job(run_dir, trusted_targets(cfg))
    index = RunIndex.load(run_dir)
    return {arm: read_train_store(index.store_path(index.units[-1], arm)) for arm in index.arm_names}


@pytest.mark.slow
@pytest.mark.parametrize("broken, amp", [(None, "bf16"), ("schedule", "bf16"), ("ema", "bf16"),
                                         (None, "fp16"), ("scaler", "fp16")])
def test_a_resume_restores_the_schedule_the_ema_and_the_scaler_bit_for_bit(tmp_path, monkeypatch, broken,
                                                                           amp):
    whole = loop_run(tmp_path / "whole", interrupt=False, amp=amp)
    if broken == "schedule":  # break it: a resume that rebuilds the scheduler at step 0
        monkeypatch.setattr(loop, "restore_schedule", lambda *a: None)
    if broken == "ema":  # break it: a resume that restarts the EMA from the restored weights
        monkeypatch.setattr(loop.EMA, "restore", lambda self, tensors: None)
    if broken == "scaler":  # break it: a resume that starts a fresh grad scaler
        monkeypatch.setattr(loop, "restore_scaler", lambda *a: None)
    resumed = loop_run(tmp_path / "resumed", interrupt=True, amp=amp)
    same = all(whole[a].digests == resumed[a].digests and all(whole[a].meta.get(k) == resumed[a].meta.get(k)
                                                              for k in ("schedule", "grad_scaler"))
               for a in whole)
    assert same == (broken is None)
    s = whole["native"]
    assert any(k.startswith("ema/") for k in s.tensors) and s.meta["schedule"]["last_epoch"] == 4
    assert ("grad_scaler" in s.meta) == (amp == "fp16")


def global_step(model, batch, noise, step):
    """A user step that draws its conditioning drop from torch's global generator: what is caught."""
    drop = torch.rand(batch["x"].shape[0]) < 0.5
    cond = torch.where(drop, torch.full_like(batch["sigma"], 80.0), batch["sigma_cond"])
    n = batch["x"] + batch["sigma"].reshape(-1, 1, 1, 1) * batch["eps"]
    return ((model(n, batch["sigma"], cond) - batch["x"]) ** 2).flatten(1).mean(1)


def keyed_step(model, batch, noise, step):
    """The same step drawing from the `noise` twinrun hands it."""
    drop = noise.uniform() < 0.5
    cond = torch.where(drop, torch.full_like(batch["sigma"], 80.0), batch["sigma_cond"])
    n = batch["x"] + batch["sigma"].reshape(-1, 1, 1, 1) * batch["eps"]
    return ((model(n, batch["sigma"], cond) - batch["x"]) ** 2).flatten(1).mean(1)


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["keyed_step", "global_step"])
def test_a_step_drawing_from_the_global_generator_is_caught_by_the_replicate_and_named(tmp_path, monkeypatch,
                                                                                    fn):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "+experiment=train_scale_lr", "train.steps=2", "train.segment_steps=1", "train.batch_size=8",
            "train.heldout_images=8", "train.device=cpu", f"train.step={{_target_: test_train_loop.{fn}}}"])
    run_dir = tmp_path / "run"
    plan_run(cfg, run_dir)
    run_job(run_dir, trusted_targets(cfg))
    index = RunIndex.load(run_dir)
    last = {a: read_train_store(index.store_path(index.units[-1], a)) for a in index.arm_names}
    replicate_same = last["native"].digests == last["native_replicate"].digests
    named = last["native"].meta.get("global_generator_steps")
    if fn == "keyed_step":
        assert replicate_same and named is None
        assert last["native"].digests == last["scale_lr_noop"].digests  # the gate holds with your step
    else:
        assert not replicate_same and named == [2]


# ----------------------------------------------------------------------------- one common objective


def test_every_arm_also_reads_its_loss_under_the_twins_objective_unweighted():
    from twinrun.interventions import WeightSigma
    from twinrun.measures import train_step as ts

    arm = arm_of(Tiny(), batch_size=16, chunk_samples=4)
    arm.intervention = WeightSigma(power=-1.0)
    x, sigma, eps = batch(16)
    start = Tiny()
    own, common = loop.loop_step(arm, arm.step_fn, x, list(range(16)), sigma, eps, 7, 1)
    with torch.no_grad():
        per = ts.per_sample_loss(start, x, sigma, eps, sigma)
    assert common.item() == pytest.approx(per.mean().item(), rel=1e-6)  # unweighted, the start model's
    assert own.item() == pytest.approx((per * (sigma / 0.5) ** -1).mean().item(), rel=1e-6)
    assert abs(own.item() - common.item()) > 0.1 * common.item()
    # An arm whose own step is not the twin's: the twin's step read on its model, without gradients.
    other = arm_of(Tiny(), batch_size=16, step={"_target_": f"{__name__}.min_snr_step"})
    _, common_other = loop.loop_step(other, other.step_fn, x, list(range(16)), sigma, eps, 7, 1,
                                     loop.twinrun_step)
    assert common_other.item() == pytest.approx(per.mean().item(), rel=1e-6)
