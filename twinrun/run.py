"""A twin run: plan it (validate, derive arms, write configs) then measure it, bin by bin.

`plan_run` runs where the user typed the command and writes everything the job needs into the
run directory before any compute; `run_job(run_dir)` is the job itself (in-process, or pickled by
submitit onto a node): it reads only the run directory, measures every arm of a bin back to back
on the same draws, and skips the bins whose stores already exist and verify (resume).
"""

import hashlib
import itertools
import json
import math
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from twinrun import draws, probe, provenance, trial
from twinrun.arms import Arm, derive_arms
from twinrun.checks import REPLICATE as GATE_REPLICATE
from twinrun.config import ProbeConfig, protocol_differences, typed
from twinrun.determinism import MATMUL_PRECISIONS
from twinrun.env import fingerprint
from twinrun.errors import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    ConfigError,
    Interrupted,
    StoreError,
    TwinrunError,
)
from twinrun.estimands import check_estimands
from twinrun.gates import GATE_RULES
from twinrun.interventions import Intervention, Native, attached
from twinrun.lock import run_lock
from twinrun.rundir import RunDir, RunIndex
from twinrun.store import (
    atomic_write,
    max_store_bytes,
    read_config,
    store_name,
    store_size,
    write_json,
    write_store,
)

# The builders a run directory may name without the user vouching for them: twinrun's own
# model, data and interventions. Anything else must come from a config the user composed (its
# `_target_`s are passed in as `trusted`) or a module named on the command line.
BUILTIN_MODULES = ("twinrun.model", "twinrun.data", "twinrun.interventions")


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def build(node: dict, key: str):
    """One level of Hydra instantiate, with a one-line error naming the key."""
    try:
        return hydra.utils.instantiate(node)
    except Exception as err:  # noqa: BLE001 — instantiate wraps every builder failure in its own exception
        cause = err.__cause__ or err
        msg = (str(cause).strip().splitlines() or [type(cause).__name__])[-1]
        raise ConfigError(f"{key}._target_", node.get("_target_"), f"could not be built: {msg}") from None


# ----------------------------------------------------------------------------- validation


def validate(cfg: DictConfig, n_available_images: int) -> None:
    """Reject bad input before any compute: each error names the key, the value and the fix."""
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
    if p.n_images > n_available_images:
        raise ConfigError("probe.n_images", p.n_images,
                          f"the data set has only {n_available_images} images; use at most that")
    if not 3 <= p.n_folds <= p.n_images:
        raise ConfigError("probe.n_folds", p.n_folds, f"must be between 3 (the jackknife SE needs 3 folds) and "
                          f"probe.n_images={p.n_images} (a fold holds ≥ 1 image)")
    if not p.params:
        raise ConfigError("probe.params", list(p.params), "give at least one pattern, e.g. ['*']")
    for key in ("chunk_images", "chunk_draws"):
        if p[key] == 0 or p[key] < -1:
            raise ConfigError(f"probe.{key}", p[key], "must be ≥ 1, or -1 for no limit")
    validate_reduce(cfg.reduce)
    if cfg.determinism.float32_matmul_precision not in MATMUL_PRECISIONS:
        raise ConfigError("determinism.float32_matmul_precision", cfg.determinism.float32_matmul_precision,
                          f"choose one of {', '.join(MATMUL_PRECISIONS)}")
    try:
        device = probe.resolve_device(p.device)
    except RuntimeError:
        raise ConfigError("probe.device", p.device, "not a torch device; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError("probe.device", p.device, "twinrun measures on cpu or cuda[:N] only (or auto)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("probe.device", p.device, "CUDA is not available here; use probe.device=cpu")
    if not 0 <= cfg.seed < 2**63:
        raise ConfigError("seed", cfg.seed, "must be in [0, 2^63): it keys every noise stream")


def check_paths(cfg: DictConfig, run_dir: Path | None) -> None:
    """Paths a run will write to: its directory's name must be UTF-8 (it is written into run.json and
    every report), and a compile cache directory the user chose must be writable."""
    if run_dir is not None:
        try:
            str(run_dir).encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError("hydra.run.dir", str(run_dir).encode("utf-8", "replace").decode(),
                              "is not valid UTF-8; choose a directory name of UTF-8 characters") from None
    cache = cfg.determinism.compile_cache_dir
    if cache is not None:
        path = Path(cache).expanduser()
        probe_dir = next((q for q in (path, *path.parents) if q.exists()), None)
        if probe_dir is None or not probe_dir.is_dir() or not os.access(probe_dir, os.W_OK | os.X_OK):
            raise ConfigError("determinism.compile_cache_dir", cache,
                              "cannot be created or written here; choose a writable directory (or null for "
                              "~/.cache/twinrun/compile)")


def check_sizes(cfg: DictConfig, image_shape, numels: list[int], n_stores: int, run_dir: Path | None) -> None:
    """Refuse at plan time what could never fit: a bin's noise in memory, the stores on disk. Prints
    the run's store size (every arm and bin, the gate replicate at its gate bins)."""
    p = cfg.probe
    noise_bytes = 4 * p.n_images * p.n_draws * math.prod(image_shape)
    memory = max_store_bytes()
    if noise_bytes > memory // 2:
        raise ConfigError("probe.n_draws", p.n_draws, f"a bin's noise for probe.n_images={p.n_images} would take "
                          f"{noise_bytes / 2**30:.1f} GiB, over half this machine's {memory / 2**30:.0f} GiB; "
                          "use fewer draws or images")
    n_params = sum(numels)  # numels: one per probed parameter tensor
    store_bytes = n_stores * store_size(p.n_folds, n_params, len(numels), p.n_images)
    where = Path(run_dir) if run_dir is not None else Path.cwd()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    print(f"twinrun: the stores will take about {store_bytes / 1e6:,.1f} MB ({store_bytes:,} bytes: {n_stores} "
          f"stores of {p.n_folds} folds x {n_params:,} parameters); {free / 1e9:,.1f} GB free at {where}", flush=True)
    if store_bytes > free and not (run_dir is not None and RunDir(run_dir).is_run()):
        # (A resume writes only the missing stores, beside those already on this disk: not refused here.)
        raise ConfigError("probe.params", list(p.params), f"the stores would take {store_bytes / 2**30:.2f} GiB "
                          f"({store_bytes} bytes), more than the {free / 2**30:.2f} GiB free at {where}; probe fewer "
                          "parameters or folds, or put the run directory on a file system with room (hydra.run.dir=..., "
                          "or hydra.sweep.dir=... for a sweep)")


def validate_reduce(r: DictConfig) -> None:
    """The analysis registered at plan time: estimands from the registry, a known gate rule."""
    check_estimands(list(r.estimands), declared_groups(r), None)
    if r.gate_rule not in GATE_RULES:
        raise ConfigError("reduce.gate_rule", r.gate_rule, f"choose one of {', '.join(GATE_RULES)}")
    if not 0 < r.signal_alpha < 0.5:
        raise ConfigError("reduce.signal_alpha", r.signal_alpha, "must be in (0, 0.5), e.g. 0.05")


def check_measures_something(intervention, grid: list[float]) -> None:
    """Refuse, before compute, an intervention that can prove nothing: neither a gate bin nor a no-op
    setting (nothing would vouch for the instrument), or one that is the twin everywhere (nothing to
    measure): its settings are its no-op setting, or it only changes σ_cond and feeds the twin's."""
    key = f"intervention({type(intervention).__name__})"
    noop = intervention.noop()
    if not intervention.gate_sigmas(grid) and noop is None:
        raise ConfigError(key, grid, "has no gate bin (no bin of the grid where it claims to be a no-op) and no "
                          "no-op setting (`noop()`, run as its machinery arm): nothing would vouch for the "
                          "instrument; add its no-op σ to sigma_grid.sigmas or declare a no-op setting")
    at_noop = noop is not None and all(getattr(intervention, k, None) == v for k, v in noop.items())
    sigma_only = type(intervention).attach is Intervention.attach
    twin = Native()
    same_sigma = all(torch.equal(intervention.sigma_cond(torch.tensor(s, dtype=torch.float32)),
                                 twin.sigma_cond(torch.tensor(s, dtype=torch.float32))) for s in grid)
    if at_noop or (sigma_only and same_sigma):
        raise ConfigError(key, grid, "a no-op everywhere: nothing to measure (its settings are the twin's in "
                          "every bin); choose settings that change something (e.g. gamma ≠ 1, factor ≠ 1)")


def declared_groups(r: DictConfig) -> dict[str, list[str]]:
    """reduce.groups as plain data ({} when none is declared): the estimand groups of the config."""
    return OmegaConf.to_container(r, resolve=True)["groups"] or {}


def check_params(c: "Components", cfg: DictConfig) -> None:
    """Every registered estimand (built-in or a reduce.groups entry) selects probed parameters of
    this model (`cond` needs conditioning ones among probe.params, which the builder matched)."""
    check_estimands(list(cfg.reduce.estimands), declared_groups(cfg.reduce), c.layout)


def check_reference(reference: str | None, mine: dict) -> str | None:
    """A reference must be an earlier run directory with a native twin measured under the same
    protocol as this run (`mine`: the twin's resolved config); checked before any compute."""
    if reference is None:
        return None
    path = Path(reference).expanduser().resolve()
    if path.parent.name == "arms":  # given an arm directory itself
        path = path.parent.parent
    try:
        index = RunIndex.load(path)
        twin = index.arm("twin")["name"]
        theirs = read_config(index.run_dir.arm_config(twin))
    except StoreError as err:
        raise ConfigError("reference", reference, f"must be an earlier, intact twinrun run directory ({err})") from None
    if not isinstance(theirs, dict):
        raise ConfigError("reference", reference, "its twin's config.yaml is not a config")
    differ = protocol_differences(theirs, mine)  # the protocol: twinrun.config.PROTOCOL_KEYS
    if differ:
        raise ConfigError("reference", reference, f"was measured under another protocol ({', '.join(differ)} "
                          "differ); a reference must share data, grid, seed, images, draws, folds and probed parameters")
    return str(path)


def fold_sizes(n_images: int, n_folds: int) -> list[int]:
    """Contiguous folds of the probe's images, as equal as possible."""
    base, extra = divmod(n_images, n_folds)
    return [base + (1 if f < extra else 0) for f in range(n_folds)]


# ----------------------------------------------------------------------------- components


@dataclass
class Components:
    """What a resolved config builds, the same way for planning and for the job: the probe's inputs."""

    model: torch.nn.Module  # on `device`
    images: torch.Tensor  # [n_images, C, H, W]: the data's first probe.n_images, on `device`
    image_ids: list[int]  # each image's id: it keys the image's noise draws
    interventions: dict[str, Intervention]  # arm name -> its intervention (hooks attached per arm)
    names: list[str]  # the probed parameters (probe.params matched against the model)
    layout: list[dict]  # the stores' columns: each probed parameter's offset, size, conditioning flag
    fold_sizes: list[int]  # images per fold (contiguous folds)
    fold_of_image: torch.Tensor  # [n_images] int64: each image's fold, on `device`
    device: torch.device


def build_components(config: dict, p: ProbeConfig, arms: list[Arm], device: torch.device,
                     data: tuple | None = None) -> Components:
    """Model, data and each arm's intervention from the arms' shared resolved config (one level of
    instantiate each), and the probe's parameter selection, layout and folds (`p`: config's probe, typed).
    data: (images, ids) when the caller has already built them (planning validates their count first)."""
    model = build(config["model"], "model").to(device)
    images, image_ids = data if data is not None else build(config["data"], "data")
    names = probe.select_params(model, list(p.params))
    sizes = fold_sizes(p.n_images, p.n_folds)
    return Components(
        model=model,
        images=images[: p.n_images].to(device),
        image_ids=list(image_ids[: p.n_images]),
        interventions={a.name: build(a.config["intervention"], "intervention") for a in arms},
        names=names,
        layout=probe.layout(model, names, probe.cond_patterns(model)),
        fold_sizes=sizes,
        fold_of_image=torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(device),
        device=device,
    )


# ----------------------------------------------------------------------------- plan


def plan_run(cfg: DictConfig, run_dir: Path | None, command: str | None = None, dry_run: bool = False) -> dict:
    """Validate, derive the twin, write configs, diff and run.json. Returns run.json's content.

    dry_run: validate only, write nothing (a sweep checks every point before the first runs).
    """
    intervention = build(OmegaConf.to_container(cfg.intervention, resolve=True), "intervention")
    data = build(OmegaConf.to_container(cfg.data, resolve=True), "data")
    validate(cfg, n_available_images=data[0].shape[0])
    grid = [float(s) for s in cfg.sigma_grid.sigmas]
    intervention.check(grid)
    arms, diff = derive_arms(cfg, intervention.name, replicate=bool(cfg.arms.replicate), noop=intervention.noop())
    p = typed(ProbeConfig, arms[0].config["probe"], "probe")
    c = build_components(arms[0].config, p, arms, torch.device("cpu"), data)  # what the job builds, on the CPU
    check_params(c, cfg)
    check_measures_something(intervention, grid)  # after derive_arms: "no intervention declared" comes first
    check_paths(cfg, run_dir)
    intervention.check_model(c.model)
    numels = [group["numel"] for group in c.layout]
    n_gate_replicates = 0 if any(a.name == GATE_REPLICATE for a in arms) else len(intervention.gate_sigmas(grid))
    check_sizes(cfg, c.images.shape[1:], numels, len(arms) * len(grid) + n_gate_replicates, run_dir)
    trial.smoke_test(c.model, c.names, p, c.images, grid[0], c.interventions)
    run = {
        "format": "twinrun-run/1",
        "status": "planned",
        "command": command,
        "reference": check_reference(cfg.reference, arms[1].config),
        "arms": [{"name": a.name, "role": a.role, "config_hash": config_hash(a.config)} for a in arms],
        # The analysis registered before any compute; `reduce` with other settings is a post-hoc view.
        "registered": {"estimands": list(cfg.reduce.estimands), "gate_rule": cfg.reduce.gate_rule,
                       "signal_alpha": float(cfg.reduce.signal_alpha),
                       **({"groups": declared_groups(cfg.reduce)} if cfg.reduce.groups else {})},
        "bins": [
            {"index": i, "sigma": s, "gate": s in intervention.gate_sigmas(grid),
             "stores": {a.name: {"file": store_name(i, s), "status": "pending"} for a in arms}}
            for i, s in enumerate(grid)
        ],
    }
    plan_gate_replicates(run, arms)
    if dry_run:
        return run
    rd = RunDir(run_dir)
    if rd.run_json.exists():
        return _resume_plan(rd, run)
    if any(GATE_REPLICATE in b["stores"] for b in run["bins"]):
        rd.arm_dir(GATE_REPLICATE).mkdir(parents=True, exist_ok=True)
    for arm in arms:
        rd.arm_dir(arm.name).mkdir(parents=True, exist_ok=True)
        atomic_write(rd.arm_config(arm.name), yaml.safe_dump(arm.config, sort_keys=False).encode())
    write_json(rd.config_diff_json, diff)
    write_json(rd.run_json, run)
    return run


def plan_gate_replicates(run: dict, arms: list[Arm]) -> None:
    """The twin is measured again at every gate bin (unless arms.replicate already does it in every
    bin): without it a gate that is not bit-identical could not tell a nondeterministic kernel
    path from an intervention that is not a no-op (twinrun/gates.py)."""
    if any(a.name == GATE_REPLICATE for a in arms):
        return
    for b in run["bins"]:
        if b["gate"]:
            b["stores"][GATE_REPLICATE] = {"file": store_name(b["index"], b["sigma"]), "status": "pending"}


def _resume_plan(rd: RunDir, planned: dict) -> dict:
    old = RunIndex.load(rd).doc
    if [a["config_hash"] for a in old["arms"]] != [a["config_hash"] for a in planned["arms"]]:
        raise StoreError(rd.path, "holds a run of a different config; use a new run directory")
    return old


# ----------------------------------------------------------------------------- the job


def targets(tree) -> list[str]:
    """Every `_target_` in a config (Hydra's instantiate follows nested ones too)."""
    if isinstance(tree, dict):
        own = [tree["_target_"]] if "_target_" in tree else []
        return own + [t for v in tree.values() for t in targets(v)]
    if isinstance(tree, list):
        return [t for v in tree for t in targets(v)]
    return []


def trusted_targets(cfg: DictConfig) -> list[str]:
    """The builders of a config the user composed (its model, data and intervention)."""
    return sorted({t for key in ("model", "data", "intervention")
                   for t in targets(OmegaConf.to_container(cfg[key], resolve=True))})


def _allowed(target, trusted) -> bool:
    if not isinstance(target, str):
        return False
    module = target.rpartition(".")[0]
    return any(module == m for m in BUILTIN_MODULES) or any(
        target == t or target.startswith(f"{t}.") for t in trusted)


def load_arms(index: RunIndex, trusted=()) -> list[Arm]:
    """Each arm's config.yaml, only if it is the config run.json hashed and names only builders
    twinrun ships or the user vouched for: a run directory is data and never runs code."""
    arms = []
    for entry in index.doc["arms"]:
        path = index.run_dir.arm_config(entry["name"])
        config = read_config(path)
        if config_hash(config) != entry["config_hash"]:
            raise StoreError(path, f"does not match the config_hash {entry['config_hash']} run.json records "
                             "for it (edited after planning?); restore it or start a new run directory")
        foreign = [t for t in targets(config) if not _allowed(t, trusted)]
        if foreign:
            raise StoreError(path, f"names the builder _target_={foreign[0]!r}, which is neither twinrun's nor "
                             "one you named: rerun your original command (with its --config-dir), or "
                             "`python -m twinrun.resume RUN_DIR --trust MODULE` if you trust that code")
        arms.append(Arm(entry["name"], config, entry["role"]))
    if all(a.name != GATE_REPLICATE for a in arms) and any(GATE_REPLICATE in b["stores"] for b in index.bins):
        arms.append(Arm(GATE_REPLICATE, next(a for a in arms if a.role == "twin").config, "replicate"))
    return arms


def run_job(run_dir: str | Path, trusted=(), bins: list[int] | None = None) -> dict:
    """Measure every pending bin, all arms back to back on the same draws; one writer at a time.

    `trusted`: builders (`_target_`s or module names) beyond twinrun's own that the arms may name.
    `bins`: measure only these bin indices (one array element of launcher.split=bins, holding only
    their locks); None = every pending bin.
    """
    rd = RunDir(run_dir)
    with run_lock(rd.path, bins):
        if bins is None:  # with bins, another element may be writing: its temp files are not stale
            for stale in rd.tmp_files():  # a write cut short by a kill: never read
                stale.unlink()
        index = RunIndex.load(rd)
        try:
            return _measure(index, load_arms(index, trusted), bins)
        except (KeyboardInterrupt, Interrupted) as err:
            index.mark_interrupted(bins)
            if isinstance(err, KeyboardInterrupt):
                raise Interrupted(EXIT_INTERRUPTED) from None
            raise


def raise_on_sigterm() -> None:
    """In an entry point's main thread: SIGTERM (kill, scancel) ends the run as "interrupted", exit 143."""
    import signal
    import threading

    def _raise(signum, frame):
        raise Interrupted(EXIT_TERMINATED)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise)


def _measure(index: RunIndex, arms: list[Arm], bins: list[int] | None = None) -> dict:
    """The job's setup: determinism first, then what planning built, typed, on this job's device."""
    config = arms[0].config  # every arm shares everything outside `intervention`
    determinism = provenance.setup_determinism(config)  # before any torch work
    p = typed(ProbeConfig, config["probe"], index.run_dir.arm_config(arms[0].name))
    c = build_components(config, p, arms, probe.resolve_device(p.device))
    return measure(index, arms, c, p, seed=config["seed"], determinism=determinism, todo=pending_bins(index, bins),
                   bins=bins)


def pending_bins(index: RunIndex, bins: list[int] | None) -> list[dict]:
    """The bins to measure: every bin not whole on disk (among `bins`, if given). The bin is the unit
    of twin validity: if any arm of it is missing, all of its arms are measured again, back to back
    in this process, rather than pair stores from two processes."""
    whole = [b["index"] for b in index.whole_bins(only=bins)]  # an element hashes its own bins' stores only
    if whole:
        print(f"twinrun: resuming: {len(whole)} of {len(index.bins)} bins already measured", flush=True)
    return [b for b in index.bins if b["index"] not in whole and (bins is None or b["index"] in bins)]


def measure(
    index: RunIndex,  # run.json: read for the bins and arms, updated as each store lands
    arms: list[Arm],  # measured in this order in every bin, on the same draws
    c: Components,  # model, images and ids, interventions, probed parameters, layout, folds, device
    p: ProbeConfig,  # the probe's settings, typed (draws per image, chunks, method, compile)
    seed: int,  # keys every noise stream, with (bin σ, image id, draw)
    determinism: dict,  # what setup_determinism applied: recorded with this job
    todo: list[dict],  # run.json bins this job measures, in grid order
    bins: list[int] | None = None,  # this array element's bins (launcher.split=bins); None: the whole run
) -> dict:
    """Measure `todo`, bin by bin; every arm of a bin back to back on one set of draws. Returns run.json."""
    hashes = {a["name"]: a["config_hash"] for a in index.doc["arms"]}
    hashes.setdefault(GATE_REPLICATE, index.arm("twin")["config_hash"])  # the twin, measured again
    image_shape = tuple(c.images.shape[1:])
    n_bins = len(index.bins)

    # Step: resolve probe.method and compile before any bin, so that the compile cache the
    # fingerprint reads next holds every kernel the bins will use.
    method, forward, mode = trial.job_trial(c.model, c.names, c.images, index.bins[0]["sigma"], c.interventions, p,
                                            c.fold_of_image, len(c.fold_sizes))

    # Step: fingerprint where this job runs; twinrun's own batching changes the arithmetic order,
    # so it joins the kernel path. A job may not add bins on another path than the whole ones.
    fp = fingerprint(mode)
    fp["kernel_path"]["probe"] = provenance.probe_arithmetic(p, method, c.device.type)
    try:
        provenance.refuse_straddling(index, fp, todo)
    except provenance.KernelPathRefused as err:
        if bins is not None:  # an array element: recorded at its bin, so the waiting launcher says exit 3
            index.mark_failed(todo[0], next(iter(todo[0]["stores"])), trial.failure_record(err))
        raise
    job = start_job(index, fp, determinism, provenance.read_sentinel(forward, c.device, image_shape))
    record = provenance.bin_record(fp, job["sentinel_start"])
    index.set_status("running", bins)  # an element never clears a failure recorded at another's bin

    progress = Progress(sum(len(b["stores"]) for b in todo))
    for b in todo:
        sigma, t_bin = b["sigma"], time.perf_counter()
        # Step: this bin's draws, keyed by (seed, σ, image id, draw): the same for every arm.
        eps = draws.noise(seed, sigma, c.image_ids, p.n_draws, image_shape)
        timings = []
        for arm in (a for a in arms if a.name in b["stores"]):
            t_arm = time.perf_counter()
            eps_dev = eps.to(c.device)
            with failure_recorded(index, b, arm.name):
                # Step: probe this arm: its σ_cond, its hooks on (and off again after).
                intervention = c.interventions[arm.name]
                sigma_cond = intervention.sigma_cond(torch.tensor(sigma, dtype=torch.float32))
                with attached(intervention, c.model):
                    sums = trial.as_model_error(arm.name, b, probe.fold_sums, c.model, c.names, c.images, eps_dev,
                                                sigma, sigma_cond.to(c.device), c.fold_of_image, len(c.fold_sizes),
                                                p.chunk_images, p.chunk_draws, method=method, forward=forward)
                probe.check_finite(sums, arm.name, b["index"], sigma)
                # Step: store the sums with what they are (written atomically), then mark them done.
                meta = {"arm": arm.name, "bin_index": b["index"], "sigma": sigma,
                        "sigma_cond": float(sigma_cond), "n_images": p.n_images, "n_draws": p.n_draws,
                        "fold_sizes": c.fold_sizes, "image_ids": c.image_ids, "seed": seed,
                        "draws_digest": draws.digest(eps_dev, sigma), "config_hash": hashes[arm.name],
                        "layout": c.layout, "env": record, "kernel_path": fp["kernel_path"]}
                sha = write_store(index.store_path(b, arm.name), sums, meta)
                index.mark_done(b, arm.name, sha, record["kernel_path_sha256"])
            timings.append(f"{arm.name} {time.perf_counter() - t_arm:.2f}s")
            progress.step(f"bin {b['index'] + 1}/{n_bins} σ={sigma:g} {arm.name}")
        progress.log(f"bin {b['index'] + 1}/{n_bins} σ={sigma:g}: {', '.join(timings)} "
                     f"({time.perf_counter() - t_bin:.2f}s)")
    progress.close()

    # Step: close the job: the sentinel read again; the run is "measured" once every bin is whole.
    index.end_job(job["index"], provenance.read_sentinel(forward, c.device, image_shape)["digest"])
    index.finish_measuring()
    return index.doc


@contextmanager
def failure_recorded(index: RunIndex, b: dict, arm: str):
    """Any failure measuring one arm of a bin, ours or user code's, is recorded in run.json (which
    arm, which bin, and the model's exception) before it propagates; earlier bins stay valid."""
    try:
        yield
    except Interrupted:
        raise
    except Exception as err:  # user code may raise anything: recorded, then exit 4 (ours keep their code)
        failure = err if isinstance(err, TwinrunError) else trial.to_model_error(arm, b, err)
        index.mark_failed(b, arm, trial.failure_record(failure))
        if failure is err:
            raise
        raise failure from err


class Progress:
    """A tqdm bar with ETA on a terminal; plain log lines with ETA elsewhere (CI, SLURM logs)."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.bar = tqdm(total=total, unit="arm·bin", dynamic_ncols=True) if sys.stderr.isatty() and total else None

    def step(self, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)

    def log(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
            return
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        print(f"{line} [{self.done}/{self.total} arm·bins, ETA {eta:.0f}s]", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def start_job(index: RunIndex, fp: dict, determinism: dict, sentinel: dict) -> dict:
    """Record this job (a first run, a resume or a requeue) in run.json and its fingerprint in env/."""
    rd = index.run_dir
    rd.env_dir.mkdir(exist_ok=True)
    sha = provenance.kernel_path_sha256(fp)
    if not rd.kernel_path_env(sha).is_file():
        write_json(rd.kernel_path_env(sha), fp)
    job = {"kernel_path_sha256": sha, "hostname": fp["info"].get("hostname"), "boot_id": fp["info"].get("boot_id"),
           "slurm_job_id": (fp["info"].get("slurm") or {}).get("SLURM_JOB_ID"),
           "sentinel_start": sentinel["digest"], "sentinel_end": None}
    index.add_job(job)
    write_json(rd.job_env(job["index"]), {"fingerprint": fp, "determinism": determinism, "sentinel": sentinel})
    return job
