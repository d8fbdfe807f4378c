"""Twin sampling (measure=sample): every arm generates the same samples from the same keyed noise, the
intervention acting on the denoiser at every sampler step; a unit is a chunk of samples.

Each arm's store holds its chunk of samples and each sample's held-out denoising loss (the native
model's loss under the run's objective at sample.loss_sigmas, on keyed noise the same in every arm);
sample i is conditioned on image i's conditioning (cycling when there are more samples than images),
and the sampler integrates the run's objective (samplers.py: EDM's, the flow ODE, DDIM under vp). The
twin's replicate is an arm of every run: on a deterministic path it is bit-identical to the twin, and so
must be the machinery arm (the intervention's code at its no-op setting) where the intervention declares
one: its noop(), or else its level_noop(), since no sampler step is a gate bin (`sampling_noop`).
The reading (analysis/sample_reduce.py) is paired over samples: each arm's distance to the twin's
sample, the loss difference and an MMD² between the arms' sample distributions, each ± its SE.
"""

import hashlib
import math
import shutil
from pathlib import Path
from typing import TypedDict

import torch
from omegaconf import DictConfig, OmegaConf

from twinrun import conditioning
from twinrun.analysis.sample_reduce import reduce_sample
from twinrun.config import DeterminismConfig, SampleConfig
from twinrun.draws import keyed_normal
from twinrun.errors import ConfigError, TwinrunError
from twinrun.instantiate import build, objective_of, typed
from twinrun.interventions import Intervention, acts_through, attached
from twinrun.measures import samplers
from twinrun.measures.failures import as_model_error, failing_frame, first_line
from twinrun.measures.kind import Measure, Plan, parse_device
from twinrun.provenance.determinism import switches_kept
from twinrun.provenance.record import model_sha256, read_sentinel, tensors_sha256
from twinrun.publish import sample_report
from twinrun.storage.records import UnitEntry
from twinrun.storage.sample_store import (
    SAMPLE_STORE_FORMAT,
    SampleSummary,
    verify_sample_store,
    write_sample_store,
)

# What two sampling runs must share to have sampled the same thing (a comparison's check).
SAMPLE_PROTOCOL_KEYS = ("data", "objective", "seed", "sample.n_samples", "sample.sampler", "sample.steps",
                        "sample.sigma_min", "sample.sigma_max", "sample.rho", "sample.s_churn",
                        "sample.s_tmin", "sample.s_tmax", "sample.s_noise", "sample.eta",
                        "sample.loss_sigmas")
# Where an intervention can act while sampling; one that overrides neither acts nowhere.
SAMPLING_HOOKS = ("sigma_cond", "attach")
LOSS_STREAM = b"twinrun/sample-loss/v1"


FEATURE_STREAM = b"twinrun/sample-features/v1"
FEATURE_SEED = 20251201  # the random-feature map is fixed: the same in every run, so runs compare


class SampleUnit(TypedDict):
    """run.json's own fields of a chunk: its samples are first … first + count − 1."""

    first: int
    count: int


# ----------------------------------------------------------------------------- validation


def validate(cfg: DictConfig, intervention: Intervention) -> tuple:
    """The sampling settings and the intervention, before any compute; each error names the key, the
    value and the fix. Returns the image shape (from the data: the model's input)."""
    s = cfg.sample
    for key in ("n_samples", "chunk_samples", "steps", "random_features"):
        if not isinstance(s[key], int) or s[key] < 1:
            raise ConfigError(f"sample.{key}", s[key], "must be a positive integer")
    if s.n_samples < 4:
        raise ConfigError("sample.n_samples", s.n_samples, "must be ≥ 4 (the paired SEs need samples)")
    if s.chunk_samples < 2:
        raise ConfigError("sample.chunk_samples", s.chunk_samples, "must be ≥ 2 (a chunk's own reading is "
                          "paired over its samples)")
    if s.n_samples % s.chunk_samples:
        raise ConfigError("sample.chunk_samples", s.chunk_samples, f"must divide sample.n_samples="
                          f"{s.n_samples} (every chunk is as long as the others)")
    if s.sampler not in samplers.SAMPLERS:
        raise ConfigError("sample.sampler", s.sampler, f"choose one of {', '.join(samplers.SAMPLERS)}")
    if not (0 < s.sigma_min < s.sigma_max and math.isfinite(s.sigma_max)):
        raise ConfigError("sample.sigma_min", s.sigma_min, f"must be positive and below sample.sigma_max="
                          f"{s.sigma_max} (finite)")
    for key in ("rho", "s_noise", "feature_bandwidth"):
        if not (math.isfinite(s[key]) and s[key] > 0):
            raise ConfigError(f"sample.{key}", s[key], "must be a positive finite number")
    if not (math.isfinite(s.s_churn) and s.s_churn >= 0):
        raise ConfigError("sample.s_churn", s.s_churn, "must be ≥ 0 (0: the deterministic sampler)")
    if not (0 <= s.s_tmin <= s.s_tmax):
        raise ConfigError("sample.s_tmin", s.s_tmin, f"must be between 0 and sample.s_tmax={s.s_tmax}")
    sigmas = list(s.loss_sigmas)
    if not sigmas or not all(isinstance(x, int | float) and math.isfinite(x) and x > 0 for x in sigmas):
        raise ConfigError("sample.loss_sigmas", sigmas, "must be a non-empty list of positive σ")
    if s.features is not None and not (isinstance(s.features, DictConfig) and "_target_" in s.features):
        raise ConfigError("sample.features", s.features, "must be null (random features) or a node with a "
                          "_target_ building a torch.nn.Module that maps [B, C, H, W] to [B, F]")
    objective = objective_of(OmegaConf.to_container(cfg.objective, resolve=True) if "objective" in cfg
                             else None)
    if objective.name not in samplers.ODES:
        raise ConfigError("objective", objective.name, f"twin sampling has samplers for objective "
                          f"{', '.join(samplers.ODES)} only; choose one of them")
    check_loss_levels(objective, sigmas)
    if objective.name != "edm" and s.s_churn > 0:
        stochastic = "sample.eta > 0 is DDIM's stochastic sampler" if objective.name == "vp" else \
            f"objective={objective.name} samples its ODE deterministically"
        raise ConfigError("sample.s_churn", s.s_churn, f"EDM's stochastic sampler needs objective=edm; "
                          f"{stochastic}: set 0")
    if not (isinstance(s.eta, int | float) and math.isfinite(s.eta) and s.eta >= 0):
        raise ConfigError("sample.eta", s.eta, "must be ≥ 0 (0: the deterministic DDIM)")
    if s.eta > 0 and (objective.name != "vp" or s.sampler != "euler"):
        raise ConfigError("sample.eta", s.eta, f"DDIM's stochastic sampler needs objective=vp and "
                          f"sample.sampler=euler (DDIM itself; not {objective.name}, {s.sampler}); "
                          f"{'under edm use sample.s_churn, or ' if objective.name == 'edm' else ''}set 0")
    parse_device("sample.device", s.device)  # its spelling only: the job judges the GPU where it runs
    if cfg.reference is not None:
        raise ConfigError("reference", cfg.reference, "a sampling run takes no reference: compare two "
                          "sampling runs by their tables (`python -m twinrun.table A B`)")
    check_sampling_intervention(intervention)
    if objective.name != "vp":  # vp's grid is the model's timesteps: checked in `plan`, with the model
        check_fed(intervention, objective, samplers.levels(objective.name, s.steps, s.sigma_min, s.sigma_max,
                                                           s.rho))
    images, _, cond = conditioning.split(build(OmegaConf.to_container(cfg.data, resolve=True), "data"))
    conditioning.check(cond, images.shape[0])
    return tuple(images.shape[1:])


def check_loss_levels(objective, levels: list, model=None) -> None:
    """sample.loss_sigmas are levels of the run's objective (with the model: within its schedule)."""
    try:
        objective.check("sample.loss_sigmas", levels, model)
    except ConfigError as err:  # the objective's own fix, with this key's example instead of the grid's
        fix = err.fix.split("; e.g.")[0]
        raise ConfigError("sample.loss_sigmas", levels, f"{fix}; the held-out loss is taken at levels of "
                          f"objective={objective.name} (under flow e.g. [0.2,0.5,0.8], under vp timesteps "
                          "e.g. [100,300,600])") from None


def check_fed(intervention: Intervention, objective, grid: list[float], model=None) -> None:
    """What the intervention feeds the conditioning at every step of the sampler's grid must be a level of
    the objective (σ > 0 under edm, t in (0, 1) under flow, one of the model's timesteps under vp)."""
    levels = torch.tensor(grid[:-1]).float()
    fed = intervention.sigma_cond(levels)
    key = f"intervention({type(intervention).__name__})"
    try:
        objective.check("σ_cond", [float(v) for v in fed], model)
    except ConfigError as err:
        raise ConfigError(key, str(intervention), f"feeds the conditioning a value that is not a level at "
                          f"some step of the sampler's schedule: {err.fix.split('; e.g.')[0]}") from None
    # One that acts only on σ_cond and feeds every step its own level is a no-op everywhere (scale_cond at
    # gamma=1): its arm would be the twin, and its machinery arm would never run its code.
    if acts_through(intervention, SAMPLING_HOOKS) == ["sigma_cond"] and torch.equal(fed, levels):
        raise ConfigError(key, str(intervention), "feeds the conditioning each step's own level at every "
                          "step of the sampler's schedule: a no-op everywhere, nothing to measure; choose "
                          "settings that change something")


def sampling_noop(intervention: Intervention) -> dict | None:
    """The no-op setting a sampling run's machinery arm runs: the intervention's noop(), or else its
    level_noop() (a sampler's steps visit levels no grid fixes, so no step is the gate bin an intervention
    like pin_sigma leaves noop() to; its own code at a setting that follows every level is the gate)."""
    noop = intervention.noop()
    level_noop = getattr(intervention, "level_noop", None)  # a duck-typed plugin may not define it
    return noop if noop is not None or level_noop is None else level_noop()


def check_sampling_intervention(intervention: Intervention) -> None:
    """Refuse an intervention that acts nowhere while sampling, or sits at its no-op setting."""
    key = f"intervention({type(intervention).__name__})"
    settings = {k: v for k, v in vars(intervention).items() if not k.startswith("_")}
    if not acts_through(intervention, SAMPLING_HOOKS):
        raise ConfigError(key, settings, f"acts nowhere while sampling (it overrides none of "
                          f"{', '.join(SAMPLING_HOOKS)}): nothing to measure")
    noop = sampling_noop(intervention)
    if noop is not None and all(settings.get(k) == v for k, v in noop.items()):
        raise ConfigError(key, settings, f"is at its no-op setting {noop}: nothing to measure; choose "
                          "settings that change something")
    intervention.check_train()  # its settings, without a σ grid (a sampler visits every σ)


# ----------------------------------------------------------------------------- plan


def store_name(unit_index: int) -> str:
    return f"chunk{unit_index:03d}.safetensors"


def plan_units(s: SampleConfig) -> list[dict]:
    c = s.chunk_samples
    return [{"index": k, "label": f"chunk {k} (samples {k * c}–{k * c + c - 1})", "gate": False,
             "sample": {"first": k * c, "count": c}, "file": store_name(k)} for k in range(s.n_samples // c)]


def plan(cfg: DictConfig, intervention: Intervention, arms: list, run_dir: Path | None, shape: tuple) -> Plan:
    """One sampler step of one sample per distinct arm code on the CPU (a model or intervention that
    cannot sample is one line now, not a failed job); the units and the stores' size."""
    s = typed(SampleConfig, arms[0].config["sample"], "sample")
    model = build(arms[0].config["model"], "model").eval()
    intervention.check_model(model)
    objective = objective_of(arms[0].config.get("objective"))
    objective.check_model(model)
    images, _, cond = conditioning.split(build(arms[0].config["data"], "data"))
    conditioning.check(cond, images.shape[0], model)
    abar = schedule_of(objective, model)
    if abar is not None:  # vp: the grid is the model's timesteps, known now
        if s.steps > len(abar):
            raise ConfigError("sample.steps", s.steps, f"the model's schedule has {len(abar)} timesteps; "
                              f"DDIM visits at most that many: use ≤ {len(abar)}")
        check_loss_levels(objective, list(s.loss_sigmas), model)
        check_fed(intervention, objective, samplers.levels("vp", s.steps, 0, 0, 0, len(abar)), model)
    n_timesteps = None if abar is None else len(abar)
    grid = samplers.levels(objective.name, 1, s.sigma_min, s.sigma_max, s.rho, n_timesteps)
    tried = set()
    for arm in arms:
        code = str(arm.config["intervention"])
        if code in tried:
            continue
        tried.add(code)
        arm_intervention = build(arm.config["intervention"], "intervention")
        try:
            with torch.no_grad(), attached(arm_intervention, model):
                first = _denoiser(model, arm_intervention, conditioning.take(cond, [0]))
                samplers.integrate(objective.name, first, torch.zeros(1, *shape), grid, "euler",
                                   {**_churn(s), "s_churn": 0.0, "eta": 0.0}, abar=abar)
        except TwinrunError:
            raise
        except Exception as err:  # noqa: BLE001 — user code may raise anything: one line, exit 2
            raise ConfigError("model._target_", arms[0].config["model"].get("_target_"), f"arm {arm.name}: a "
                              f"sampler step raised {type(err).__name__}: {first_line(err)} (at "
                              f"{failing_frame(err)}); fix the model or the intervention") from None
    units = plan_units(s)
    per_store = 4 * s.chunk_samples * (math.prod(shape) + len(s.loss_sigmas)) + 4096
    store_bytes = len(arms) * len(units) * per_store
    where = Path(run_dir) if run_dir is not None else Path.cwd()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    print(f"twinrun: the stores will take about {store_bytes / 1e6:,.2f} MB ({len(arms)} arms x {len(units)} "
          f"chunks of {s.chunk_samples} samples); {free / 1e9:,.1f} GB free at {where}", flush=True)
    if store_bytes > free:
        raise ConfigError("sample.n_samples", s.n_samples, f"the stores would take {store_bytes / 2**30:.2f} "
                          f"GiB, more than the {free / 2**30:.2f} GiB free at {where}")
    return Plan(units=units, store_bytes=store_bytes)


def _denoiser(model: torch.nn.Module, intervention: Intervention, cond: dict):
    """The model as a function of (x, level) as the arm sees it: its level_cond at every step, and each
    sample's own conditioning rows `cond` (its hooks are attached by the caller)."""
    return lambda x, level: model(x, level, intervention.sigma_cond(level), **cond)


def _churn(s: SampleConfig) -> dict:
    return {"s_churn": s.s_churn, "s_tmin": s.s_tmin, "s_tmax": s.s_tmax, "s_noise": s.s_noise, "eta": s.eta}


def schedule_of(objective, model: torch.nn.Module) -> torch.Tensor | None:
    """The model's ᾱ over its timesteps (float64, CPU) where the objective's sampler reads it (vp)."""
    if objective.name != "vp":
        return None
    return objective.schedule(model).detach().to("cpu", torch.float64)


# ----------------------------------------------------------------------------- the job's session


class SampleSession:
    """Twin sampling in one job: the model on this job's device, each arm's intervention, and each
    chunk's noise (drawn once, consumed by every arm)."""

    compile_mode = None  # sampling runs eagerly

    def __init__(self, config: dict, arms: list, device: torch.device):
        self.s = typed(SampleConfig, config["sample"], "sample")
        self.seed, self.device = config["seed"], device
        pinned = typed(DeterminismConfig, config["determinism"], "determinism").enabled
        with switches_kept(f"model._target_={config['model'].get('_target_')}", pinned):
            self.model = build(config["model"], "model").to(device).eval()
        images, _, self.cond = conditioning.split(build(config["data"], "data"))
        self.shape = tuple(images.shape[1:])
        self.objective = objective_of(config.get("objective"))
        self.interventions = {a.name: build(a.config["intervention"], "intervention") for a in arms}
        self.abar = schedule_of(self.objective, self.model)
        self.sigmas = samplers.levels(self.objective.name, self.s.steps, self.s.sigma_min, self.s.sigma_max,
                                      self.s.rho, None if self.abar is None else len(self.abar))
        # What was sampled: the loss levels and the conditioning (none: the digest as before it existed).
        self.identity = {"model_sha256": model_sha256(self.model),
                         "data_sha256": tensors_sha256([("loss_sigmas", torch.tensor(self.s.loss_sigmas)),
                                                        *conditioning.digest_items(self.cond)])}
        if getattr(self.model, "adapter_sha256", None) is not None:  # a LoRA adapter's file content
            self.identity["adapter_sha256"] = self.model.adapter_sha256
        self.features = (build(config["sample"]["features"], "sample.features").to(device).eval()
                         if config["sample"].get("features") else None)
        if self.features is None:  # random Fourier features of an RBF kernel on the pixel vector
            d, m = math.prod(self.shape), self.s.random_features
            w = keyed_normal(FEATURE_STREAM, FEATURE_SEED, (0,), (d, m)) / self.s.feature_bandwidth
            phase = keyed_normal(FEATURE_STREAM, FEATURE_SEED, (1,), (m,)).remainder(1.0) * 2 * math.pi
            self.w, self.b = w.to(device), phase.to(device)
        self.noise = self.step_noise = self.loss_noise = None
        self.unit_cond: dict = {}
        self.noise_digest = ""

    def arithmetic(self) -> dict:
        return {"device": self.device.type}

    def sentinel(self) -> dict:
        return read_sentinel(conditioning.with_first(self.model, conditioning.to(self.cond, self.device)),
                             self.device, self.shape)

    def begin_unit(self, u: UnitEntry) -> None:
        # This chunk's noise, keyed by (seed, sample index[, step]): the same for every arm.
        ids = list(range(u["sample"]["first"], u["sample"]["first"] + u["sample"]["count"]))
        self.noise = samplers.initial_noise(self.seed, ids, self.shape)
        # Sample i's conditioning is image i's (cycling through the images), sliced as the samples are.
        rows = torch.tensor(ids, dtype=torch.long) % images_of(self.cond, len(ids))
        self.unit_cond = conditioning.to(conditioning.take(self.cond, rows), self.device)
        noised = samplers.noised_steps(self.objective.name, self.sigmas, _churn(self.s))
        self.step_noise = {k: samplers.step_noise(self.seed, ids, k, self.shape) for k in noised}
        self.loss_noise = torch.stack([torch.stack([keyed_normal(LOSS_STREAM, self.seed, (i, j), self.shape)
                                                    for j in range(len(self.s.loss_sigmas))]) for i in ids])
        h = hashlib.sha256()
        for t in (self.noise, *self.step_noise.values(), self.loss_noise):
            h.update(t.numpy().astype("<f4").tobytes())
        self.noise_digest = h.hexdigest()

    def measure(self, u: UnitEntry, arm: str, stamp: dict) -> tuple[dict, dict]:
        """Sample this arm's chunk, then each sample's held-out loss; the store's tensors and metadata."""
        intervention = self.interventions[arm]
        with torch.no_grad():
            with attached(intervention, self.model):
                x = as_model_error(arm, u, samplers.integrate, self.objective.name,
                                   _denoiser(self.model, intervention, self.unit_cond),
                                   self.noise.to(self.device), self.sigmas, self.s.sampler, _churn(self.s),
                                   lambda k: self.step_noise[k], self.abar)
            loss = as_model_error(arm, u, self.heldout_loss, x)
            features = as_model_error(arm, u, self.feature_map, x)
        meta = {"arm": arm, "unit_index": u["index"], "first": u["sample"]["first"],
                "count": u["sample"]["count"], "seed": self.seed, "config_hash": stamp["config_hash"],
                "noise_digest": self.noise_digest, "sampler": self.s.sampler, "steps": self.s.steps,
                "loss_sigmas": [float(v) for v in self.s.loss_sigmas], "env": stamp["env"],
                "kernel_path": stamp["kernel_path"]}
        return {"samples": x.cpu(), "loss": loss.cpu(), "features": features.cpu()}, meta

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """[n, F] float32: the features the MMD reads (the user's net, or the fixed random map)."""
        if self.features is not None:
            return self.features(x).flatten(1).float()
        return math.sqrt(2.0 / self.w.shape[1]) * torch.cos(x.flatten(1) @ self.w + self.b)

    def heldout_loss(self, x: torch.Tensor) -> torch.Tensor:
        """[n, L]: the native model's loss under the run's objective on each sample at each loss level (no
        intervention: the same yardstick for every arm), on the chunk's keyed noise and each sample's
        own conditioning."""
        out, obj = [], self.objective
        for j, level in enumerate(self.s.loss_sigmas):
            lev = torch.full((x.shape[0],), float(level), device=self.device)
            eps = self.loss_noise[:, j].to(self.device)
            output = self.model(obj.noisy(self.model, x, eps, lev), lev, **self.unit_cond)
            # λ(level) in float64, applied as one number (the level is the same for every sample)
            weight = float(obj.weight(self.model, torch.tensor(float(level), dtype=torch.float64)))
            out.append(weight * ((output - obj.target(self.model, x, eps, lev)) ** 2).flatten(1).mean(1))
        return torch.stack(out, 1).float()


def images_of(cond: dict, default: int) -> int:
    """How many images the conditioning has rows for (`default` without conditioning: any row count)."""
    return next(iter(cond.values())).shape[0] if cond else default


SAMPLE = Measure(
    name="sample",
    settings_key="sample",
    unit_noun="chunk",
    validate=validate,
    plan=plan,
    protocol_keys=SAMPLE_PROTOCOL_KEYS,
    open_session=SampleSession,
    device=lambda config: config["sample"]["device"],
    reduce=reduce_sample,
    report=sample_report.write_report,
    render=sample_report.render,
    config_keys=("sample",),
    replicate_always=True,  # the determinism control every gate reads
    noop=sampling_noop,
    store_format=SAMPLE_STORE_FORMAT,
    unit_fields=SampleUnit,
    summary_type=SampleSummary,
    unit_key="first",
    unit_own="first",
    tracker_rows=sample_report.tracker_rows,
    sweep_point=sample_report.sweep_point,
    default_arithmetic=lambda method, device_type: {"device": device_type},  # as SampleSession's
    write_store=write_sample_store,
    verify_store=verify_sample_store,
    not_comparable="twin sampling's arms are compared by their runs' tables (`python -m twinrun.table A B`) "
                   "and bit for bit by `python -m twinrun.diff A B`",
)
