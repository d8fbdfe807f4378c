"""What a real training loop has, for one arm: its learning-rate schedule, gradient clipping, gradient
accumulation over micro-batches, bf16 autocast (or fp16 with a grad scaler), torch.compile and an EMA of
the weights; and each one's state as a segment's store holds it and a resume reads it back bit for bit.

Every setting is the arm's own (`ArmState.t`: the twin's, or an override's), so any of them can be the
intervention. docs/training.md ("What the loop has").
"""

import hashlib
import math
from contextlib import nullcontext

import hydra
import torch

from twinrun import conditioning
from twinrun.errors import ConfigError
from twinrun.measures import train_step as ts
from twinrun.measures.failures import first_line
from twinrun.measures.train_streams import SampleNoise
from twinrun.storage.records import UnitEntry

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The autocast dtypes whose gradients underflow without loss scaling: a GradScaler of the arm's own.
SCALED = ("fp16",)
EMA_PREFIX = "ema/"


# ----------------------------------------------------------------------------- schedules


class WarmupThen:
    """The factor on the base learning rate at step s: linear from 1/(warmup+1) up to 1 over `warmup_steps`,
    then `decay(progress)` for progress 0 → 1 at `total_steps`. A class, not a lambda: LambdaLR stores a
    callable object's attributes in its state_dict, so a store records the shape it followed."""

    def __init__(self, warmup_steps: int, total_steps: int, end: float = 0.0):
        self.warmup_steps, self.total_steps, self.end = warmup_steps, total_steps, end

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        span = max(1, self.total_steps - self.warmup_steps)
        return self.decay(min(1.0, (step - self.warmup_steps) / span))

    def decay(self, progress: float) -> float:
        raise NotImplementedError


class WarmupCosine(WarmupThen):
    """Warmup, then a half cosine from 1 down to `end` (the schedule's min_factor)."""

    def decay(self, progress: float) -> float:
        return self.end + (1 - self.end) * 0.5 * (1 + math.cos(math.pi * progress))


class Linear(WarmupThen):
    """Warmup, then linear from 1 down to `end` (the schedule's end_factor)."""

    def decay(self, progress: float) -> float:
        return 1 + (self.end - 1) * progress


def constant(optimizer) -> None:
    """train/schedule=constant (the default): no scheduler at all, so a constant-rate arm computes exactly
    what it did before schedules existed."""


def warmup_cosine(optimizer, warmup_steps: int, total_steps: int, min_factor: float = 0.0):
    """train/schedule=warmup_cosine: a LambdaLR over WarmupCosine."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_factor))


def linear(optimizer, warmup_steps: int, total_steps: int, end_factor: float = 0.0):
    """train/schedule=linear: a LambdaLR over Linear."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, Linear(warmup_steps, total_steps, end_factor))


def build_schedule(node, optimizer: torch.optim.Optimizer):
    """The arm's scheduler (stepped once after every optimizer step), or None for a constant rate. Any
    `torch.optim.lr_scheduler` class (or a function returning one) by `_target_`, called with the
    optimizer and the node's other keys."""
    if node is None or node.get("_target_") is None:
        return None
    kwargs = {k: v for k, v in node.items() if not k.startswith("_")}
    try:
        return hydra.utils.get_method(node["_target_"])(optimizer, **kwargs)
    except Exception as err:  # noqa: BLE001 — the user's scheduler may raise anything: one line, exit 2
        raise ConfigError("train.schedule._target_", node.get("_target_"), f"could not be built: "
                          f"{type(err).__name__}: {first_line(err)}") from None


def schedule_record(scheduler) -> dict | None:
    """The scheduler's state_dict as JSON values (a store's metadata), or None without one."""
    if scheduler is None:
        return None
    return {k: _plain(v) for k, v in scheduler.state_dict().items()}


def restore_schedule(scheduler, optimizer: torch.optim.Optimizer, record: dict | None) -> None:
    """The scheduler's state read back, and every param group's learning rate set to the one it last
    gave (a freshly built scheduler has set step 0's)."""
    if scheduler is None:
        return
    if record is None:
        raise ValueError("the store holds no scheduler state")
    scheduler.load_state_dict(dict(record))
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr


def _plain(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise ValueError(f"a scheduler state value of type {type(value).__name__} is not stored")


# ----------------------------------------------------------------------------- EMA


class EMA:
    """An exponential moving average of the trainable weights, θ_ema ← θ_ema + (1 − decay)·(θ − θ_ema)
    after every optimizer step (one fused lerp: the same bits in every arm with the same weights). It
    starts at the start weights and is stored beside them (`ema/<parameter>`)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.shadow = {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(list(self.shadow.values()), [p.detach() for p in self.params.values()],
                             1.0 - self.decay)

    def record(self) -> dict[str, torch.Tensor]:
        return {f"{EMA_PREFIX}{n}": t.detach().cpu() for n, t in self.shadow.items()}

    @torch.no_grad()
    def restore(self, tensors: dict) -> None:
        for n, t in self.shadow.items():
            t.copy_(tensors[f"{EMA_PREFIX}{n}"])


def build_ema(decay, model: torch.nn.Module) -> EMA | None:
    return None if decay is None else EMA(model, float(decay))


# ----------------------------------------------------------------------------- grad scaler


def build_scaler(t, device: torch.device):
    """train.amp=fp16's loss scaler (torch.amp.GradScaler on the arm's device, the CPU too: its defaults),
    or None: bf16 and float32 need none."""
    return torch.amp.GradScaler(device.type) if t.amp in SCALED else None


def scaler_record(scaler) -> dict | None:
    """The scaler's state as JSON (a store's metadata): its scale is a float32 and its growth tracker an
    int, both exact as JSON numbers; None without one."""
    return None if scaler is None else {k: _plain(v) for k, v in scaler.state_dict().items()}


def restore_scaler(scaler, record: dict | None) -> None:
    if scaler is None:
        return
    if not isinstance(record, dict) or not record:
        raise ValueError("the store holds no grad scaler state")
    scaler.load_state_dict(dict(record))


# ----------------------------------------------------------------------------- one step's settings


def check_loop(t) -> None:
    """The loop's settings, before any compute (each error names the key, the value and the fix)."""
    if t.clip_norm is not None and not (math.isfinite(t.clip_norm) and t.clip_norm > 0):
        raise ConfigError("train.clip_norm", t.clip_norm, "must be a positive norm, or null for no clipping")
    if not isinstance(t.accumulate, int) or t.accumulate < 1:
        raise ConfigError("train.accumulate", t.accumulate, "must be a positive number of micro-batches "
                          "per optimizer step (1: none)")
    if t.amp is not None and t.amp not in AMP_DTYPES:
        raise ConfigError("train.amp", t.amp, f"must be null (float32) or one of {', '.join(AMP_DTYPES)}")
    if t.ema is not None and not (0 < t.ema < 1):
        raise ConfigError("train.ema", t.ema, "must be a decay in (0, 1), e.g. 0.999, or null for no EMA")


def autocast(t, device: torch.device):
    """The forward's autocast (bf16 or fp16, on the CPU too), or nothing at float32."""
    if t.amp is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[t.amp])


def compiled(model: torch.nn.Module, mode: str | None):
    """The arm's model as its step calls it: itself, or torch.compile's module of it (train.compile).
    Static shapes: the session compiles every shape a segment runs before the first one, so no
    automatic-dynamic recompile lands mid-run on another kernel (and in a cache the fingerprint read)."""
    return None if mode is None else torch.compile(model, mode=mode, dynamic=False)


def step_samples(t) -> int:
    """Samples one optimizer step consumes: `accumulate` micro-batches of `batch_size`."""
    return t.batch_size * t.accumulate


# ----------------------------------------------------------------------------- the step


def twinrun_step(model: torch.nn.Module, batch: dict, noise: SampleNoise, step: int) -> torch.Tensor:
    """twinrun's own step (train.step: null): the run's objective's per-sample loss
    (train_step.per_sample_loss) on the batch's keyed draws, each sample fed its own conditioning rows;
    it draws nothing from `noise`."""
    return ts.per_sample_loss(model, batch["x"], batch["sigma"], batch["eps"], batch["sigma_cond"],
                              batch.get("objective"), batch.get("cond"))


def build_step(node):
    """The arm's step function: twinrun's, or yours by `train.step._target_` (looked up, not called)."""
    if node is None or node.get("_target_") is None:
        return twinrun_step
    try:
        fn = hydra.utils.get_method(node["_target_"])
    except Exception as err:  # noqa: BLE001 — a name that does not resolve: one line, exit 2
        raise ConfigError("train.step._target_", node.get("_target_"), f"could not be found: "
                          f"{first_line(err)}; name a function of (model, batch, noise, step)") from None
    extra = {k: v for k, v in node.items() if not k.startswith("_")}
    return (lambda model, batch, noise, step: fn(model, batch, noise, step, **extra)) if extra else fn


def arm_salt(arm: str) -> int:
    """What a step of your own finds the global generator's per-step seed xor-ed with: the arm's own."""
    return int.from_bytes(hashlib.sha256(f"twinrun/train-global/{arm}".encode()).digest()[:7], "little")


def loop_step(arm, step_fn, x: torch.Tensor, ids: list[int], sigma: torch.Tensor, eps: torch.Tensor,
              seed: int, step: int, common_fn=None, cond: dict | None = None,
              objective=None, before_update=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step of one arm (its own settings `arm.t`): `accumulate` micro-batches of
    `batch_size`, each forward and backward in chunks of ≤ `chunk_samples` (the memory knob), the loss
    the mean of the per-sample losses over the step's samples (an intervention's loss weight applied);
    then clipping, the update, the schedule's step and the EMA's. Returns (the arm's own loss, the same
    batch's loss under the common objective: the twin's step, unweighted), both 0-d and detached.
    `common_fn`: the twin's step where it is not the arm's (None: the arm's own, read from its forward).
    `cond`: the step's samples' conditioning rows (aligned with `x`); `objective`: the run's (None: edm).
    A step function sees both in its batch (`batch["cond"]`, `batch["objective"]`). `before_update`: called
    once the forwards and backwards are done, before anything writes a weight (the last step's digests,
    computed meanwhile on another thread, are waited for there)."""
    t, model, intervention = arm.t, arm.model, arm.intervention
    forward = model if arm.forward is None else arm.forward  # its compiled module (train.compile)
    n, micro = x.shape[0], t.batch_size
    chunk = micro if t.chunk_samples == -1 else t.chunk_samples
    arm.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=x.device)
    common = torch.zeros((), device=x.device)
    for m0 in range(0, n, micro):
        end = min(m0 + micro, n)
        for lo in range(m0, end, chunk):
            part = slice(lo, min(lo + chunk, end))
            batch = {"x": x[part], "ids": ids[part], "sigma": sigma[part], "eps": eps[part],
                     "sigma_cond": intervention.sigma_cond(sigma[part]),
                     "sigma_data": getattr(model, "sigma_data", 1.0),
                     "cond": conditioning.take(cond or {}, part), "objective": objective}
            with autocast(t, x.device):
                losses = step_fn(forward, batch, SampleNoise(seed, step, ids[part], x.device), step)
            check_losses(losses, part.stop - part.start)
            losses = losses.float()
            common += (losses.detach() if common_fn is None else
                       _common(common_fn, forward, batch, seed, step, ids[part], t, x.device)).sum() / n
            weight = intervention.loss_weight(sigma[part], getattr(model, "sigma_data", 1.0))
            if weight is not None:
                losses = losses * weight
            loss = losses.sum() / n
            (loss if arm.scaler is None else arm.scaler.scale(loss)).backward()
            total += loss.detach()
    if before_update is not None:
        before_update()
    if arm.scaler is not None:  # fp16: the gradients unscaled before clipping; a step with inf skipped
        arm.scaler.unscale_(arm.optimizer)
    if t.clip_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], t.clip_norm)
    if arm.scaler is None:
        arm.optimizer.step()
    else:
        arm.scaler.step(arm.optimizer)
        arm.scaler.update()
    if arm.scheduler is not None:
        arm.scheduler.step()
    if arm.ema is not None:
        arm.ema.update()
    return total, common


def _common(common_fn, model, batch: dict, seed: int, step: int, ids: list[int], t, device) -> torch.Tensor:
    """The twin's per-sample losses of the arm's model on this chunk, without gradients and leaving every
    generator where it was (the arm's own training draws on as if this forward never ran)."""
    gpus = [device.index or 0] if device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=gpus), autocast(t, device):
        return common_fn(model, batch, SampleNoise(seed, step, ids, device), step).float()


def check_losses(losses, n: int) -> None:
    if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (n,):
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ConfigError("train.step._target_", shape, f"a step must return the {n} per-sample losses of "
                          f"its batch (a tensor of shape ({n},)), not their mean")


def check_finite(arm: str, u: UnitEntry, losses: torch.Tensor, held: torch.Tensor, model: torch.nn.Module,
                 steps: list[int]) -> None:
    """A NaN or inf loss or weight stops the run there, naming the arm, the step and the segment."""
    bad = (~torch.isfinite(losses)).nonzero()
    where = f"arm {arm}, {u['label']}"
    keep = "earlier segments are kept; lower train.optimizer.lr or check the model, then start a new run"
    if len(bad):
        raise ts.NonFiniteLoss(f"{where}: the training loss is NaN or inf at step {steps[int(bad[0])]}; "
                               f"{keep}")
    finite = bool(torch.isfinite(held).all()) and all(bool(torch.isfinite(p).all())
                                                       for p in model.parameters())
    if not finite:
        raise ts.NonFiniteLoss(f"{where}: the weights are NaN or inf after step {steps[-1] if steps else 0}; "
                               f"{keep}")
