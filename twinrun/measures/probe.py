"""The σ probe, twinrun's first measurement kind: per-fold gradient sums of each arm at each noising σ.

Its unit is a σ bin: every arm of a bin is measured back to back in one process on one set of draws,
keyed by (seed, σ, image id, draw). Planning validates the probe's settings, builds what the job
will build (on the CPU) and runs the trial eagerly; the job's session builds it again where it
measures, resolves probe.method and compile there, and measures one arm of one bin at a time.
"""

import base64
import itertools
import math
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from twinrun import caches, conditioning, draws, objectives
from twinrun.analysis.estimands import check_estimands, declared_groups
from twinrun.analysis.probe_reduce import reduce_run
from twinrun.config import DeterminismConfig, ProbeConfig
from twinrun.errors import ConfigError
from twinrun.files import memory_bytes
from twinrun.instantiate import build, objective_of, typed
from twinrun.interventions import Intervention, Native, attached
from twinrun.measures import failures, trial
from twinrun.measures import fold_sums as fs
from twinrun.measures.kind import Measure, Plan, parse_device
from twinrun.measures.modes import draws_randomness, set_mode
from twinrun.measures.probe_cost import check_device_memory, estimate_cost, estimate_memory, out_of_memory
from twinrun.protocol import PROTOCOL_KEYS
from twinrun.provenance.determinism import switches_kept
from twinrun.provenance.record import model_sha256, read_sentinel, tensors_sha256
from twinrun.publish import probe_rows
from twinrun.publish.probe_report import write_report
from twinrun.publish.render import render
from twinrun.storage.header import MAX_HEADER_BYTES
from twinrun.storage.records import ProbeUnit, Summary, UnitEntry
from twinrun.storage.store import header_size, store_size


def store_name(bin_index: int, sigma: float) -> str:
    return f"bin{bin_index:02d}_sigma{sigma:g}.safetensors"


def bin_label(bin_index: int, sigma: float) -> str:
    return f"bin {bin_index} (σ={sigma:g})"


def fold_sizes(n_images: int, n_folds: int) -> list[int]:
    """Contiguous folds of the probe's images, as equal as possible."""
    base, extra = divmod(n_images, n_folds)
    return [base + (1 if f < extra else 0) for f in range(n_folds)]


# ----------------------------------------------------------------------------- validation


def validate(cfg: DictConfig, intervention: Intervention) -> tuple:
    """The probe's own settings, grid and data, before any compute; each error names the key, value and
    fix. Returns the data (images, ids, cond), built once for planning."""
    grid = list(cfg.sigma_grid.sigmas)
    if not grid:
        raise ConfigError("sigma_grid.sigmas", grid, "is empty; give at least one σ, e.g. [0.1,0.5,1.0]")
    if not all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in grid):
        raise ConfigError("sigma_grid.sigmas", grid, "every σ must be a positive finite number")
    if any(b <= a for a, b in itertools.pairwise(grid)):
        raise ConfigError("sigma_grid.sigmas", grid,
                          f"must be strictly increasing without duplicates, e.g. {sorted(set(grid))}")
    p = cfg.probe
    if p.n_draws < 1:
        raise ConfigError("probe.n_draws", p.n_draws, "must be ≥ 1")
    if p.n_images < 3:
        raise ConfigError("probe.n_images", p.n_images, "must be ≥ 3 (the estimator needs 3 folds)")
    if not 3 <= p.n_folds <= p.n_images:
        raise ConfigError("probe.n_folds", p.n_folds, "must be between 3 (the jackknife SE needs 3 folds) "
                          f"and probe.n_images={p.n_images} (a fold holds ≥ 1 image)")
    if not p.params:
        raise ConfigError("probe.params", list(p.params), "give at least one pattern, e.g. ['*']")
    for key in ("chunk_images", "chunk_draws"):
        if p[key] == 0 or p[key] < -1:
            raise ConfigError(f"probe.{key}", p[key], "must be ≥ 1, or -1 for no limit")
    if p.accumulator_dtype not in fs.ACCUMULATORS:
        raise ConfigError("probe.accumulator_dtype", p.accumulator_dtype,
                          f"choose {' or '.join(fs.ACCUMULATORS)}")
    parse_device("probe.device", p.device)  # its spelling only: the job judges the GPU where it runs
    data = conditioning.split(build(OmegaConf.to_container(cfg.data, resolve=True), "data"))
    if p.n_images > data[0].shape[0]:
        raise ConfigError("probe.n_images", p.n_images,
                          f"the data set has only {data[0].shape[0]} images; use at most that")
    conditioning.check(data[2], data[0].shape[0])
    objective_of(OmegaConf.to_container(cfg.objective, resolve=True) if "objective" in cfg
                           else None).check("sigma_grid.sigmas", [float(s) for s in grid])
    intervention.check([float(s) for s in grid])
    return data


def check_measures_something(intervention: Intervention, grid: list[float]) -> None:
    """Refuse, before compute, an intervention that can prove nothing: neither a gate bin nor a no-op
    setting (nothing would vouch for the instrument), or one that is the twin everywhere (nothing to
    measure): its settings are its no-op setting, or it only changes σ_cond and feeds the twin's."""
    key = f"intervention({type(intervention).__name__})"
    noop = intervention.noop()
    if not intervention.gate_sigmas(grid) and noop is None:
        raise ConfigError(key, grid, "has no gate bin (no bin of the grid where it claims to be a no-op) and "
                          "no no-op setting (`noop()`, run as its machinery arm): nothing would vouch for "
                          "the instrument; add its no-op σ to sigma_grid.sigmas or declare a no-op setting")
    at_noop = noop is not None and all(getattr(intervention, k, None) == v for k, v in noop.items())
    sigma_only = type(intervention).attach is Intervention.attach
    twin = Native()
    same_sigma = all(torch.equal(intervention.sigma_cond(torch.tensor(s, dtype=torch.float32)),
                                 twin.sigma_cond(torch.tensor(s, dtype=torch.float32))) for s in grid)
    if at_noop or (sigma_only and same_sigma):
        raise ConfigError(key, grid, "a no-op everywhere: nothing to measure (its settings are the twin's in "
                          "every bin); choose settings that change something (e.g. gamma ≠ 1, factor ≠ 1)")


def check_sizes(cfg: DictConfig, image_shape, numels: list[int], n_stores: int, run_dir: Path | None) -> int:
    """Refuse at plan time what could never fit: a bin's noise in memory, the stores on disk. Prints
    the run's store size (every arm and bin, the gate replicate at its gate bins); returns it."""
    p = cfg.probe
    noise_bytes = 4 * p.n_images * p.n_draws * math.prod(image_shape)
    memory = memory_bytes()
    if noise_bytes > memory // 2:
        raise ConfigError("probe.n_draws", p.n_draws, f"a bin's noise for probe.n_images={p.n_images} "
                          f"would take {noise_bytes / 2**30:.1f} GiB, over half this machine's "
                          f"{memory / 2**30:.0f} GiB; use fewer draws or images")
    n_params = sum(numels)  # numels: one per probed parameter tensor
    pairing = fs.half_draws(p.n_draws) is not None
    header = header_size(p.n_folds, len(numels), p.n_images, pairing)
    if header > MAX_HEADER_BYTES:  # a store whose header its own reader refuses: never written
        raise ConfigError("probe.n_folds", p.n_folds, f"each store's header would take about "
                          f"{header / 2**20:,.0f} MiB ({len(numels):,} probed tensors x {p.n_folds}² "
                          f"fold pairs of pairing blocks), over the {MAX_HEADER_BYTES // 2**20} MiB a "
                          "store's header may hold; use fewer folds or probe fewer parameter tensors "
                          "(probe.params)")
    store_bytes = n_stores * store_size(p.n_folds, n_params, len(numels), p.n_images, pairing)
    where = Path(run_dir) if run_dir is not None else Path.cwd()
    while not os.path.exists(where):  # (os.path: a name too long is "absent", not an OSError)
        where = where.parent
    free = shutil.disk_usage(where).free
    print(f"twinrun: the stores will take about {store_bytes / 1e6:,.1f} MB ({store_bytes:,} bytes: "
          f"{n_stores} stores of {p.n_folds} folds x {n_params:,} parameters); {free / 1e9:,.1f} GB free "
          f"at {where}", flush=True)
    resuming = run_dir is not None and (Path(run_dir) / "run.json").exists()
    if store_bytes > free and not resuming:
        # (A resume writes only the missing stores, beside those already on this disk: not refused here.)
        raise ConfigError("probe.params", list(p.params), f"the stores would take {store_bytes / 2**30:.2f} "
                          f"GiB ({store_bytes} bytes), more than the {free / 2**30:.2f} GiB free at {where}; "
                          "probe fewer parameters or folds, or put the run directory on a file system "
                          "with room (hydra.run.dir=..., or hydra.sweep.dir=... for a sweep)")
    return store_bytes


# ----------------------------------------------------------------------------- components


@dataclass
class Components:
    """What a resolved config builds, the same way for planning and for the job: the probe's inputs."""

    model: torch.nn.Module  # on `device`
    images: torch.Tensor  # [n_images, C, H, W]: the data's first probe.n_images, on `device`
    image_ids: list[int]  # each image's id: it keys the image's noise draws
    cond: dict  # per-image conditioning {name: [n_images, ...]} on `device` ({} for none)
    data_files: dict  # {path: sha256} of every cache the data builder read (twinrun.caches)
    objective: objectives.Objective  # noising, target and weight of the loss whose gradients are summed
    interventions: dict[str, Intervention]  # arm name -> its intervention (hooks attached per arm)
    names: list[str]  # the probed parameters (probe.params matched against the model)
    layout: list[dict]  # the stores' columns: each probed parameter's offset, size, conditioning flag
    fold_sizes: list[int]  # images per fold (contiguous folds)
    fold_of_image: torch.Tensor  # [n_images] int64: each image's fold, on `device`
    device: torch.device


def build_components(config: dict, p: ProbeConfig, arms: list, device: torch.device,
                     data: tuple | None = None) -> Components:
    """Model, data and each arm's intervention from the arms' shared resolved config (one level of
    instantiate each), and the probe's parameter selection, layout and folds (`p`: config's probe, typed).
    data: (images, ids[, cond]) when the caller has already built them (planning validates their count first).

    Each builder runs after the job applied determinism: one that changes a numerics switch is named,
    and set back under determinism.enabled=true (provenance.determinism.switches_kept)."""
    pinned = typed(DeterminismConfig, config["determinism"], "determinism").enabled

    def built(key: str, node: dict):
        with switches_kept(f"{key}._target_={node.get('_target_')}", pinned):
            return build(node, key)

    model = built("model", config["model"]).to(device)
    with caches.recording() as data_files:
        data = data if data is not None else built("data", config["data"])
    images, image_ids, cond = conditioning.split(data)
    names = fs.select_params(model, list(p.params))
    sizes = fold_sizes(p.n_images, p.n_folds)
    return Components(
        model=model,
        images=images[: p.n_images].to(device),
        image_ids=list(image_ids[: p.n_images]),
        cond=conditioning.to(conditioning.take(cond, slice(0, p.n_images)), device),
        data_files=data_files,
        objective=objective_of(config.get("objective")),
        interventions={a.name: built("intervention", a.config["intervention"]) for a in arms},
        names=names,
        layout=fs.layout(model, names, fs.cond_patterns(model)),
        fold_sizes=sizes,
        fold_of_image=torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(device),
        device=device,
    )


# ----------------------------------------------------------------------------- plan


def plan(cfg: DictConfig, intervention: Intervention, arms: list, run_dir: Path | None, data: tuple) -> Plan:
    """Build what the job will build (on the CPU), check it, run the trial; the run's σ bins."""
    grid = [float(s) for s in cfg.sigma_grid.sigmas]
    p = typed(ProbeConfig, arms[0].config["probe"], "probe")
    c = build_components(arms[0].config, p, arms, torch.device("cpu"), data)
    conditioning.check(c.cond, c.images.shape[0], c.model)
    c.objective.check_model(c.model)
    c.objective.check("sigma_grid.sigmas", grid, c.model)
    set_mode(conditioning.with_first(c.model, c.cond), c.images, grid[0], p.train_mode, announce=True)
    check_estimands(list(cfg.reduce.estimands), declared_groups(cfg.reduce), c.layout)
    check_measures_something(intervention, grid)
    intervention.check_model(c.model)
    gates = intervention.gate_sigmas(grid)
    replicated = any(a.name == "native_replicate" for a in arms)  # else measured at the gate bins
    n_stores = len(arms) * len(grid) + (0 if replicated else len(gates))
    store_bytes = check_sizes(cfg, c.images.shape[1:], [g["numel"] for g in c.layout], n_stores, run_dir)
    try:
        method = trial.smoke_test(c.model, c.names, p, c.images, grid[0], c.interventions, c.objective,
                                  c.cond, key=trial.trial_key(arms[0].config, grid[0], "trial"))
    except Exception as err:
        if failures.is_out_of_memory(err):  # this host's memory: named as memory, never as the model's fault
            raise out_of_memory(err, "the trial run at plan time", None, p, c.device) from err
        raise
    timing = trial.trial_key(arms[0].config, grid[0], f"cost {method}")
    estimate_cost(cfg, c, method, grid[0], n_stores, timing)
    if parse_device("probe.device", p.device)[0] != "cpu":  # (on the CPU: host memory, estimate_cost)
        memory = estimate_memory(p, c, method, grid[0])
        print(f"twinrun: device memory per arm and bin, estimated for probe.method={method}: "
              f"{memory.describe(p)}; the job checks it against its GPU's free memory", flush=True)
    payload = 4 * p.n_folds * sum(g["numel"] for g in c.layout)  # float32 [numel, n_folds] per parameter
    units = [{"index": i, "label": bin_label(i, s), "gate": s in gates, "probe": {"sigma": s},
              "file": store_name(i, s), "payload_bytes": payload} for i, s in enumerate(grid)]
    return Plan(units=units, store_bytes=store_bytes)


# ----------------------------------------------------------------------------- the job's session


def arithmetic(p: ProbeConfig, method: str, device: str) -> dict:
    """The probe settings that change the arithmetic of a store, not what it measures: they join the
    kernel path (a resume or a reference under other settings is another path). `method` is the
    resolved one (vmap | folds), never `auto`, and so is `device` (cpu | cuda)."""
    return {"method": method, "compile": p.compile or False, "device": device,  # null compile is eager
            "chunk_images": p.chunk_images, "chunk_draws": p.chunk_draws,
            "accumulator_dtype": p.accumulator_dtype}


class ProbeSession:
    """The probe in one job: components built on this job's device, the trial's method and compiled
    forward, and each bin's draws (drawn once, consumed by every arm of the bin)."""

    def __init__(self, config: dict, arms: list, device: torch.device):
        self.p = typed(ProbeConfig, config["probe"], "probe")
        self.seed = config["seed"]
        self.c = build_components(config, self.p, arms, device)
        self.image_shape = tuple(self.c.images.shape[1:])
        self.eps = None
        self.twin = next(a.name for a in arms if a.role == "twin")
        self.halves = fs.half_draws(self.p.n_draws)
        self.twin_sums = None  # this bin's twin (S, H), measured first (Measure.twin_first)
        sigma0 = _first_sigma(config)
        self.plain = conditioning.with_first(self.c.model, self.c.cond)  # for calls without conditioning
        set_mode(self.plain, self.c.images, sigma0, self.p.train_mode, announce=False)
        # What is measured, on every store: the model as built (weights loaded), the probed images and
        # their conditioning (none: the digest is the images' alone, as before conditioning existed).
        self.identity = {"model_sha256": model_sha256(self.c.model),
                         "data_sha256": tensors_sha256([("images", self.c.images),
                                                        ("image_ids", torch.tensor(self.c.image_ids))]
                                                       + conditioning.digest_items(self.c.cond))}
        if getattr(self.c.model, "adapter_sha256", None) is not None:  # a LoRA adapter's file content
            self.identity["adapter_sha256"] = self.c.model.adapter_sha256
        if self.c.data_files:  # the caches read, file by file (none: the identity is as before caches)
            self.identity["data_files"] = self.c.data_files
        random_ops = self.p.train_mode and draws_randomness(self.plain, self.c.images, sigma0)
        self.train_stream = self.seed if random_ops else None
        # Resolve probe.method and compile before any bin, so that the compile cache the fingerprint
        # reads next holds every kernel the bins will use.
        self.memory = None
        with self.memory_named("the trial run before the first bin"):
            self.method, self.forward, self.compile_mode = trial.job_trial(
                self.c.model, self.c.names, self.c.images, sigma0, self.c.interventions, self.p,
                self.c.fold_of_image, len(self.c.fold_sizes), self.c.objective, self.c.cond)
        # Before the first bin: the bins' memory, estimated on this device, against what it has free.
        self.memory = estimate_memory(self.p, self.c, self.method, sigma0)
        check_device_memory(self.memory, self.p, device)

    @contextmanager
    def memory_named(self, where: str):
        """Running out of device memory is named as such, with the estimate and the knobs (exit 6)."""
        try:
            yield
        except Exception as err:
            if failures.is_out_of_memory(err):
                raise out_of_memory(err, where, self.memory, self.p, self.c.device) from err
            raise

    def arithmetic(self) -> dict:
        # twinrun's own batching changes the arithmetic order, so it joins the kernel path.
        return arithmetic(self.p, self.method, self.c.device.type)

    def sentinel(self) -> dict:
        return read_sentinel(conditioning.with_first(self.forward, self.c.cond), self.c.device,
                             self.image_shape)

    def begin_unit(self, u: UnitEntry) -> None:
        # This bin's draws, keyed by (seed, σ, image id, draw): the same for every arm.
        self.eps = draws.noise(self.seed, u["probe"]["sigma"], self.c.image_ids, self.p.n_draws,
                               self.image_shape)
        self.twin_sums = None

    def measure(self, u: UnitEntry, arm: str, stamp: dict) -> tuple[dict, dict]:
        """Probe this arm at this bin (its σ_cond, its hooks on and off again), as the store's tensors."""
        c, p, sigma = self.c, self.p, u["probe"]["sigma"]
        eps = self.eps.to(c.device)
        intervention = c.interventions[arm]
        sigma_cond = intervention.sigma_cond(torch.tensor(sigma, dtype=torch.float32))
        second_from = None if self.halves is None else self.halves[0]
        with attached(intervention, c.model), self.memory_named(f"arm {arm}, {u['label']}"):
            out = failures.as_model_error(arm, u, fs.fold_sums, c.model, c.names, c.images, eps, sigma,
                                       sigma_cond.to(c.device), c.fold_of_image, len(c.fold_sizes),
                                       p.chunk_images, p.chunk_draws, method=self.method,
                                       forward=self.forward, train_stream=self.train_stream,
                                       accumulator=fs.ACCUMULATORS[p.accumulator_dtype],
                                       second_from=second_from, objective=c.objective, cond=c.cond)
        sums, second = out if second_from is not None else (out, None)
        fs.check_finite(sums, arm, u["index"], sigma)
        pairing = None
        if second is not None:
            h = half_difference(sums, second, self.halves)
            s = sums.double()  # the stored float32 sums: the blocks agree with what the reducer reads
            if arm == self.twin:
                self.twin_sums = (s, h)
            assert arm == self.twin or self.twin_sums is not None, "the twin is measured first in every bin"
            pairing = pairing_meta(s, h, None if arm == self.twin else self.twin_sums, c.layout)
        meta = {"arm": arm, "bin_index": u["index"], "sigma": sigma, "sigma_cond": float(sigma_cond),
                "n_images": p.n_images, "n_draws": p.n_draws, "fold_sizes": c.fold_sizes,
                "image_ids": c.image_ids, "seed": self.seed, "draws_digest": draws.digest(eps, sigma),
                "config_hash": stamp["config_hash"], **self.identity, "layout": c.layout,
                "half_draws": self.halves, "pairing": pairing,
                "env": stamp["env"], "kernel_path": stamp["kernel_path"]}
        return fold_tensors(sums, c.layout), meta


def half_difference(sums: torch.Tensor, second: torch.Tensor, halves: list[int]) -> torch.Tensor:
    """H_f = sqrt(k1·k2)·(S_f1/k1 − S_f2/k2) [F, P] float64: the images' share cancels (every image is in
    both halves), the draw noise keeps the whole sum's covariance (twinrun.analysis.pairing)."""
    k1, k2 = halves
    return math.sqrt(k1 * k2) * ((sums.double() - second) / k1 - second / k2)


def encode_blocks(x: torch.Tensor) -> str:
    """A float64 [n_tensors, F, F] block as base64 of its little-endian bytes (exact, in the metadata the
    file's sha256 covers)."""
    return base64.b64encode(x.cpu().contiguous().numpy().astype("<f8").tobytes()).decode("ascii")


def tensor_blocks(x: torch.Tensor, y: torch.Tensor, layout: list[dict]) -> torch.Tensor:
    """[n_tensors, F, F] float64: ⟨x_f, y_g⟩ over each probed parameter's columns (x, y: [F, P])."""
    return torch.stack([x[:, g["offset"] : g["offset"] + g["numel"]] @ y[:, g["offset"] : g["offset"]
                                                                         + g["numel"]].T for g in layout])


def pairing_meta(s: torch.Tensor, h: torch.Tensor, twin: tuple | None, layout: list[dict]) -> dict:
    """The store's pairing blocks (docs/estimator.md, "The pairing receipt"): ⟨S,H⟩ and ⟨H,H⟩ of this arm
    and, for any arm but the twin (twin = its (S, H), measured first), ⟨S,H^tw⟩, ⟨S^tw,H⟩ and ⟨H,H^tw⟩."""
    blocks = {"s_h": tensor_blocks(s, h, layout), "h_h": tensor_blocks(h, h, layout)}
    if twin is not None:
        s_tw, h_tw = twin
        blocks |= {"s_htwin": tensor_blocks(s, h_tw, layout), "stwin_h": tensor_blocks(s_tw, h, layout),
                   "h_htwin": tensor_blocks(h, h_tw, layout)}
    return {k: encode_blocks(v) for k, v in blocks.items()}


def _first_sigma(config: dict) -> float:
    return float(config["sigma_grid"]["sigmas"][0])


def fold_tensors(sums: torch.Tensor, layout: list[dict]) -> dict[str, torch.Tensor]:
    """The fold sums [n_folds, n_params] float32 as one [numel, n_folds] tensor per probed parameter.

    Parameter-major: a parameter's column range [lo, hi) is one contiguous byte range of the store,
    so the reducer streams every store front to back in column chunks, reading each byte once."""
    assert sums.dtype == torch.float32 and sums.dim() == 2, (sums.dtype, sums.shape)
    sums = sums.cpu()
    return {g["name"]: sums[:, g["offset"] : g["offset"] + g["numel"]].T.contiguous() for g in layout}


PROBE = Measure(
    name="probe",
    settings_key="probe",
    unit_noun="bin",
    validate=validate,
    plan=plan,
    protocol_keys=PROTOCOL_KEYS,
    open_session=ProbeSession,
    device=lambda config: config["probe"]["device"],
    reduce=reduce_run,
    report=write_report,
    render=render,
    config_keys=("probe", "sigma_grid"),
    compiles=lambda config: trial.compile_mode(config["probe"].get("compile")) is not None,
    twin_first=True,  # every other arm's pairing blocks need the twin's sums and half-draw differences
    unit_fields=ProbeUnit,
    increasing="sigma",  # the σ grid: each σ once, in order
    summary_type=Summary,
    unit_key="sigma",
    unit_own="sigma",
    tracker_rows=probe_rows.tracker_rows,
    tracker_step="sigma",  # σ itself (in millionths where a tracker's step is an integer: trackers/)
    sweep_point=probe_rows.sweep_point,
    sweep_protocol="probe",
    compile_setting=lambda config: ("probe.compile", config["probe"].get("compile")),
    default_arithmetic=lambda method, device_type: arithmetic(ProbeConfig(), method or "vmap", device_type),
    methods=("vmap", "folds"),
)
