"""The probe's trial run: before any bin, each arm's model runs one tiny probe under the chosen method.

It decides `probe.method=auto` (vmap when the model runs under vmap, else folds: a rule, not a
timing, so the same model and torch always take the same path), compiles the model's forward
for `probe.compile`, and turns a model that cannot run into one line naming the failing op and
the fix, before a bin is spent. Plan time runs it eagerly on the CPU; the job runs it
again where it measures (compiling there, after determinism has moved the compile caches).
"""

import json
import logging

import torch

from twinrun import conditioning
from twinrun.config import ProbeConfig
from twinrun.errors import ConfigError, raise_signal_in
from twinrun.interventions import Intervention, attached
from twinrun.measures import fold_sums as fs
from twinrun.measures.failures import (
    determinism_cause,
    determinism_error,
    failing_frame,
    first_line,
    is_out_of_memory,
)
from twinrun.measures.modes import draws_randomness
from twinrun.provenance.record import model_sentinel_fn
from twinrun.provenance.sentinel import repeats_backward

log = logging.getLogger(__name__)

# What probe.compile accepts (YAML `false` arrives as a bool); torch.compile's own mode names.
COMPILE_MODES = ("default", "max-autotune")
# Seed of the trial's draws (the same bits every time).
TRIAL_SEED = 20251201
# What this process's plan-time trials found, by trial_key: the points of a sweep planned here (each one
# twice: checked dry, then planned) share a model and its probe settings, so the model runs its trial
# (and its timed call, probe_cost) once per distinct key, not once per point.
PLANNED: dict[str, object] = {}


def trial_key(config: dict, sigma: float, what: str) -> str:
    """What a plan-time trial or timing of the arm config `config` depends on: the model, the data, the
    objective, the probe settings, the first σ and the interventions' classes with their settings that
    are no numbers (a module's name; a swept factor or σ changes no op the model runs).
    `what` names the memo's user."""
    def shape(node):
        return {k: v for k, v in (node or {}).items()
                if not isinstance(v, int | float) or isinstance(v, bool)}
    return json.dumps([what, config.get("model"), config.get("data"), config.get("objective"),
                       config.get("probe"), sigma, shape(config.get("intervention"))],
                      sort_keys=True, default=str)


def compile_mode(value, key: str = "probe.compile") -> str | None:
    """A compile setting (`key`: probe.compile, train.compile) as torch.compile's mode, None for eager; a
    one-line error for anything else."""
    if value in (False, None, "false", "False"):
        return None
    if value not in COMPILE_MODES:
        raise ConfigError(key, value, f"choose false, {' or '.join(COMPILE_MODES)}")
    return value


def check_method(method: str, mode: str | None, random_ops: bool = False) -> None:
    if method not in fs.METHODS:
        raise ConfigError("probe.method", method, f"choose one of {', '.join(fs.METHODS)}")
    if method == "vmap" and mode is not None:
        raise ConfigError("probe.method", method, "torch.compile runs under the folds method only; set "
                          "probe.method=folds (or auto), or probe.compile=false")
    if method == "vmap" and random_ops:
        raise ConfigError("probe.method", method, "with probe.train_mode=true the model draws randomness "
                          "(dropout), which only the folds method draws from one stream for every arm; set "
                          "probe.method=folds (or auto), or probe.train_mode=false")


def candidates(method: str, mode: str | None, random_ops: bool = False) -> list[str]:
    """The methods to try, in order: auto prefers vmap (it batches small folds) unless compiling or the
    model draws randomness in train mode (only the folds method shares it between arms)."""
    if method != "auto":
        return [method]
    return ["folds"] if mode is not None or random_ops else ["vmap", "folds"]


def prepare(model: torch.nn.Module, names: list[str], method: str, mode: str | None) -> torch.nn.Module:
    """What the probe calls: the model, or its compiled module. The folds method differentiates the
    model's own parameters, so exactly the probed ones require grad there."""
    if method == "folds":
        wanted = set(names)
        for name, param in model.named_parameters():
            param.requires_grad_(name in wanted)
    if mode is None:
        return model
    return torch.compile(model, mode=mode)


def refuse_compiled_hooks(mode: str | None, interventions: dict, key: str = "probe.compile") -> None:
    """torch.compile does not see forward hooks added after compiling (dynamo skips hook guards on
    nn.Modules), so an intervention that acts through hooks would silently do nothing compiled."""
    hooked = [arm for arm, i in interventions.items() if type(i).attach is not Intervention.attach]
    if mode is not None and hooked:
        raise ConfigError(key, mode, f"arm {hooked[0]} acts through forward hooks, which a compiled model "
                          f"does not see; set {key}=false for this intervention")


def smoke_test(model: torch.nn.Module, names: list[str], p: ProbeConfig, images: torch.Tensor, sigma: float,
               interventions: dict, objective=None, cond: dict | None = None, *,
               key: str | None = None) -> str:
    """Plan time: each arm's model, eager, on the CPU; returns the method chosen. With `key` (trial_key),
    a trial this process already ran under the same key is not run again (a sweep's later points)."""
    if key is not None and key in PLANNED:
        print(f"twinrun: probe.method={p.method}: {PLANNED[key]}, as the trial run at plan time found for an "
              "earlier point (same model, data and probe settings)", flush=True)
        return PLANNED[key]
    method = _smoke_test(model, names, p, images, sigma, interventions, objective, cond)
    if key is not None:
        PLANNED[key] = method
    return method


def _smoke_test(model: torch.nn.Module, names: list[str], p: ProbeConfig, images: torch.Tensor, sigma: float,
                interventions: dict, objective=None, cond: dict | None = None) -> str:
    """smoke_test's trial itself.

    Nothing here touches a GPU or Inductor: in a local run the job follows in this process, and its
    determinism must come before CUDA's first use (cuBLAS reads its workspace setting once) and
    before Inductor binds its cache dirs. The job repeats the trial on its own device, compiling."""
    device = torch.device("cpu")
    sigma_conds = {arm: i.sigma_cond(torch.tensor(sigma, dtype=torch.float32)).to(device)
                   for arm, i in interventions.items()}
    mode = compile_mode(p.compile)
    cond = conditioning.to(conditioning.take(cond or {}, slice(0, 4)), device)
    plain = conditioning.with_first(model, cond)  # (the behaviour check passes no conditioning)
    random_ops = p.train_mode and draws_randomness(plain, images.to(device), sigma)
    check_method(p.method, mode, random_ops)
    refuse_compiled_hooks(mode, interventions)
    tried = []
    method, _ = run_trial(model, names, images[:4].to(device), sigma, sigma_conds, p.method,
                          interventions=interventions, random_ops=random_ops, tried=tried,
                          objective=objective, cond=cond)
    if p.method == "auto":
        why = ("; ".join(f"{m} failed: {type(e).__name__}: {first_line(e)}" for m, e in tried) if tried
               else "the model draws randomness in train mode" if random_ops else "it runs this model")
        print(f"twinrun: probe.method=auto chose {method} ({why}; trial run on {device} before any bin)",
              flush=True)
    if random_ops:
        print("twinrun: probe.train_mode=true: the model's randomness (dropout) is drawn from a stream keyed "
              "by (seed, σ, fold group, draw), the same in every arm", flush=True)
    return method


def job_trial(model, names, images, sigma: float, interventions: dict, p: ProbeConfig, fold_of_image,
              n_folds: int, objective=None, cond: dict | None = None):
    """The job, before its first bin: (method, forward to probe with, compile mode or None)."""
    mode = compile_mode(p.compile)
    cond = cond or {}
    random_ops = p.train_mode and draws_randomness(conditioning.with_first(model, cond), images, sigma)
    sigma_conds = {arm: i.sigma_cond(torch.tensor(sigma, dtype=torch.float32)).to(images.device)
                   for arm, i in interventions.items()}
    method, forward = run_trial(model, names, images, sigma, sigma_conds, p.method, mode, interventions,
                                random_ops=random_ops, objective=objective, cond=cond)
    if mode is not None:
        warm_up(model, forward, names, images, sigma, next(iter(sigma_conds.values())), p, fold_of_image,
                n_folds, objective, cond)
    log.info("probe method %s, compile %s", method, mode or "off")
    return method, forward, mode


def warm_up(model, forward, names, images, sigma, sigma_cond, p: ProbeConfig, fold_of_image,
            n_folds: int, objective=None, cond: dict | None = None) -> None:
    """Compile every shape the bins and the sentinel will run (one bin's worth of calls, seeded
    draws), so the cache the fingerprint then reads is the cache the whole run uses: a resume on
    the same cache finds the same digest instead of the entries the first job's bins added."""
    gen = torch.Generator().manual_seed(TRIAL_SEED)
    eps = torch.randn((images.shape[0], p.n_draws, *images.shape[1:]), generator=gen).to(images.device)
    halves = fs.half_draws(p.n_draws)  # the pairing receipt's second-half pieces are shapes of their own
    fs.fold_sums(model, names, images, eps, sigma, sigma_cond, fold_of_image, n_folds, p.chunk_images,
                 p.chunk_draws, method="folds", forward=forward, second_from=halves and halves[0],
                 objective=objective, cond=cond)
    # The sentinel's model op as the job will read it (forward only where its backward need not repeat).
    model_sentinel_fn(conditioning.with_first(forward, cond or {}), images.device, tuple(images.shape[1:]),
                      repeats_backward(images.device))()


def run_trial(
    model: torch.nn.Module,
    names: list[str],
    images: torch.Tensor,  # [N ≥ 2, C, H, W] on the device
    sigma: float,
    sigma_conds: dict[str, torch.Tensor],  # arm -> 0-d σ_cond at this σ
    method: str,
    mode: str | None = None,
    interventions: dict | None = None,  # arm -> Intervention: its hooks are on during its trial
    random_ops: bool = False,  # the model draws randomness (train mode): only the folds method
    tried: list | None = None,  # filled with (method, error) of each method that failed
    objective=None,  # twinrun.objectives.Objective; None = edm
    cond: dict | None = None,  # per-image conditioning of `images` {name: [N, ...]}
) -> tuple[str, torch.nn.Module]:
    """(the method chosen, the forward to probe with); ConfigError (exit 2) if none can run."""
    check_method(method, mode, random_ops)
    tried = [] if tried is None else tried
    for candidate in candidates(method, mode, random_ops):
        forward = prepare(model, names, candidate, mode if candidate == "folds" else None)
        try:
            for arm, sigma_cond in sigma_conds.items():
                with attached((interventions or {}).get(arm, Intervention()), model):
                    tiny_probe(model, forward, names, images, sigma, sigma_cond, candidate, objective, cond)
        except Exception as err:  # any failure of user code is reported, not raised as is
            raise_signal_in(err)  # a signal, not the method's failure: never a reason to try the next one
            # Neither memory nor determinism is a reason to take another method: `auto` is a rule
            # about the model (does it run under vmap), so each is reported as what it is.
            if is_out_of_memory(err):
                raise
            if determinism_cause(err) is not None:
                raise determinism_error(err, f"the trial run under probe.method={candidate}") from err
            tried.append((candidate, err))
            continue
        return candidate, forward
    raise ConfigError("probe.method", method, cannot_run(tried, mode))


def tiny_probe(model, forward, names, images, sigma, sigma_cond, method, objective=None,
               cond: dict | None = None) -> None:
    """Four images in two folds, two draws each: batches of more than one sample per group, since
    some ops take other paths at size 1 (diffusers' UNet runs under vmap with one image per group
    and fails with two)."""
    gen = torch.Generator().manual_seed(TRIAL_SEED)
    index = torch.arange(4, device=images.device) % images.shape[0]
    eps = torch.randn((4, 2, *images.shape[1:]), generator=gen).to(images.device)
    folds = torch.tensor([0, 0, 1, 1], device=images.device)
    fs.fold_sums(model, names, images[index], eps, sigma, sigma_cond, folds, 2, method=method,
                 forward=forward, objective=objective, cond=conditioning.take(cond or {}, index))


def cannot_run(tried: list[tuple[str, BaseException]], mode: str | None) -> str:
    """One line: what failed under which method, where in the model, and the fix."""
    parts = [f"under {m} the model raised {type(e).__name__}: {first_line(e)} (at {failing_frame(e)})"
             for m, e in tried]
    last = tried[-1][0]
    if last == "vmap":
        fix = "set probe.method=folds (one plain backward per fold chunk: no vmap, any nn.Module)"
    elif mode is not None:
        fix = "set probe.compile=false, or make the model compile"
    else:
        fix = "the model fails a plain forward and backward: fix it, or probe other parameters"
    return f"{'; '.join(parts)}; {fix}"
