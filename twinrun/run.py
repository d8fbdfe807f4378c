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
import sys
import time
from pathlib import Path

import hydra
import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from twinrun import draws, probe, provenance, trial
from twinrun.arms import Arm, derive_arms
from twinrun.determinism import MATMUL_PRECISIONS
from twinrun.env import fingerprint
from twinrun.errors import ConfigError, StoreError
from twinrun.lock import run_lock
from twinrun.store import atomic_write, read_json, read_store, store_name, write_json, write_store


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
    if p.n_images < 2:
        raise ConfigError("probe.n_images", p.n_images, "must be ≥ 2 (the estimator needs 2 folds)")
    if p.n_images > n_available_images:
        raise ConfigError("probe.n_images", p.n_images,
                          f"the data set has only {n_available_images} images; use at most that")
    if not 2 <= p.n_folds <= p.n_images:
        raise ConfigError("probe.n_folds", p.n_folds,
                          f"must be between 2 and probe.n_images={p.n_images} (a fold holds ≥ 1 image)")
    if not p.params:
        raise ConfigError("probe.params", list(p.params), "give at least one pattern, e.g. ['*']")
    for key in ("chunk_images", "chunk_draws"):
        if p[key] == 0 or p[key] < -1:
            raise ConfigError(f"probe.{key}", p[key], "must be ≥ 1, or -1 for no limit")
    unknown = [e for e in cfg.reduce.estimands if e not in ("all", "cond", "residual")]
    if unknown or not cfg.reduce.estimands:
        raise ConfigError("reduce.estimands", list(cfg.reduce.estimands), "choose from all, cond, residual")
    if not 0 < cfg.reduce.gate_threshold <= 1:
        raise ConfigError("reduce.gate_threshold", cfg.reduce.gate_threshold, "must be in (0, 1]")
    if cfg.determinism.float32_matmul_precision not in MATMUL_PRECISIONS:
        raise ConfigError("determinism.float32_matmul_precision", cfg.determinism.float32_matmul_precision,
                          f"choose one of {', '.join(MATMUL_PRECISIONS)}")
    try:
        device = probe.resolve_device(p.device)
    except RuntimeError:
        raise ConfigError("probe.device", p.device, "not a torch device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("probe.device", p.device, "CUDA is not available here; use probe.device=cpu")


def check_params(model: torch.nn.Module, cfg: DictConfig) -> None:
    """probe.params must match parameters, and `cond` needs conditioning ones among them."""
    names = probe.select_params(model, list(cfg.probe.params))
    has_cond = any(e["cond"] for e in probe.layout(model, names, probe.cond_patterns(model)))
    if "cond" in cfg.reduce.estimands and not has_cond:
        raise ConfigError("reduce.estimands", list(cfg.reduce.estimands),
                          f"`cond` needs conditioning parameters among probe.params={list(cfg.probe.params)} "
                          f"(the model's are {probe.cond_patterns(model) or 'not declared'}); drop `cond` "
                          "or probe them")


# The protocol a reference must share with the run (chunking and device do not change what is
# measured). The model config is not part of it: weights move between paths and machines, and the
# parameter layout, which is, is checked store by store when the reference is read.
PROTOCOL_CONFIG = ("data", "sigma_grid", "seed")
PROTOCOL_PROBE = ("n_images", "n_draws", "n_folds", "params")


def check_reference(reference: str | None, mine: dict) -> str | None:
    """A reference must be an earlier run directory with a native twin measured under the same
    protocol as this run (`mine`: the twin's resolved config); checked before any compute."""
    if reference is None:
        return None
    path = Path(reference).expanduser().resolve()
    if path.name == "native" and path.parent.name == "arms":  # given the arm directory itself
        path = path.parent.parent
    if not (path / "run.json").is_file() or not (path / "arms" / "native").is_dir():
        raise ConfigError("reference", reference, "must be an earlier twinrun run directory (with run.json "
                          "and arms/native/)")
    try:
        theirs = yaml.safe_load((path / "arms" / "native" / "config.yaml").read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError("reference", reference, f"its arms/native/config.yaml is unreadable ({err})") from None
    differ = [k for k in PROTOCOL_CONFIG if theirs.get(k) != mine.get(k)]
    differ += [f"probe.{k}" for k in PROTOCOL_PROBE if (theirs.get("probe") or {}).get(k) != mine["probe"].get(k)]
    if differ:
        raise ConfigError("reference", reference, f"was measured under another protocol ({', '.join(differ)} "
                          "differ); a reference must share data, grid, seed, images, draws, folds and probed parameters")
    return str(path)


def fold_sizes(n_images: int, n_folds: int) -> list[int]:
    """Contiguous folds of the probe's images, as equal as possible."""
    base, extra = divmod(n_images, n_folds)
    return [base + (1 if f < extra else 0) for f in range(n_folds)]


# ----------------------------------------------------------------------------- plan


def plan_run(cfg: DictConfig, run_dir: Path, command: str | None = None) -> dict:
    """Validate, derive the twin, write configs, diff and run.json. Returns run.json's content."""
    run_dir = Path(run_dir)
    intervention = build(OmegaConf.to_container(cfg.intervention, resolve=True), "intervention")
    images, _ = build(OmegaConf.to_container(cfg.data, resolve=True), "data")
    validate(cfg, n_available_images=images.shape[0])
    grid = [float(s) for s in cfg.sigma_grid.sigmas]
    intervention.check(grid)
    model = build(OmegaConf.to_container(cfg.model, resolve=True), "model")
    check_params(model, cfg)
    arms, diff = derive_arms(cfg, intervention.name, replicate=bool(cfg.arms.replicate))
    trial.smoke_test(model, OmegaConf.to_container(cfg.probe, resolve=True), images, grid[0],
                     {a.name: build(a.config["intervention"], "intervention") for a in arms})
    run = {
        "format": "twinrun-run/1",
        "status": "planned",
        "command": command,
        "reference": check_reference(cfg.reference, arms[1].config),
        "arms": [{"name": a.name, "role": a.role, "config_hash": config_hash(a.config)} for a in arms],
        "estimands": list(cfg.reduce.estimands),
        "gate_threshold": float(cfg.reduce.gate_threshold),
        "bins": [
            {"index": i, "sigma": s, "gate": s in intervention.gate_sigmas(grid),
             "stores": {a.name: {"file": store_name(i, s), "status": "pending"} for a in arms}}
            for i, s in enumerate(grid)
        ],
    }
    existing = run_dir / "run.json"
    if existing.exists():
        return _resume_plan(existing, run)
    for arm in arms:
        (run_dir / "arms" / arm.name).mkdir(parents=True, exist_ok=True)
        atomic_write(run_dir / "arms" / arm.name / "config.yaml", yaml.safe_dump(arm.config, sort_keys=False).encode())
    write_json(run_dir / "config_diff.json", diff)
    write_json(existing, run)
    return run


def _resume_plan(path: Path, planned: dict) -> dict:
    old = read_json(path)
    if [a["config_hash"] for a in old.get("arms", [])] != [a["config_hash"] for a in planned["arms"]]:
        raise StoreError(path.parent, "holds a run of a different config; use a new run directory")
    return old


# ----------------------------------------------------------------------------- the job


def load_arms(run_dir: Path, run: dict) -> list[Arm]:
    return [Arm(a["name"], yaml.safe_load((run_dir / "arms" / a["name"] / "config.yaml").read_text()), a["role"])
            for a in run["arms"]]


def bin_done(run_dir: Path, b: dict, arm: str) -> bool:
    """A bin's store counts as done only if it exists and its sha256 matches run.json."""
    entry = b["stores"][arm]
    if entry.get("status") != "done":
        return False
    try:
        read_store(run_dir / "arms" / arm / entry["file"], entry.get("sha256"))
        return True
    except StoreError as err:
        print(f"twinrun: re-measuring {err}")
        return False


def run_job(run_dir: str | Path) -> dict:
    """Measure every pending bin, all arms back to back on the same draws; one writer at a time."""
    run_dir = Path(run_dir)
    with run_lock(run_dir):
        for stale in run_dir.glob("arms/*/.*.tmp-*"):  # a write cut short by a kill: never read
            stale.unlink()
        return _measure(run_dir)


def _measure(run_dir: Path) -> dict:
    run = read_json(run_dir / "run.json")
    arms = load_arms(run_dir, run)
    cfg = arms[0].config  # every arm shares everything outside `intervention`
    # Step: pin determinism before any torch work.
    determinism = provenance.setup_determinism(cfg)
    p = cfg["probe"]
    device = probe.resolve_device(p["device"])
    model = build(cfg["model"], "model").to(device)
    images_all, image_ids_all = build(cfg["data"], "data")
    images = images_all[: p["n_images"]].to(device)
    image_ids = list(image_ids_all[: p["n_images"]])
    names = probe.select_params(model, list(p["params"]))
    layout = probe.layout(model, names, probe.cond_patterns(model))
    sizes = fold_sizes(p["n_images"], p["n_folds"])
    fold_of_image = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(device)
    interventions = {a.name: build(a.config["intervention"], "intervention") for a in arms}
    hashes = {a["name"]: a["config_hash"] for a in run["arms"]}
    # Step: resolve probe.method and compile before any bin, then read where this job runs: the compile
    # cache the fingerprint reads then holds every kernel the bins will use.
    method, forward, mode = trial.job_trial(model, names, images, run["bins"][0]["sigma"], interventions, p,
                                            fold_of_image, len(sizes))
    fp = fingerprint(mode)
    fp["kernel_path"]["probe"] = provenance.probe_arithmetic({**p, "method": method, "device": device.type})
    provenance.refuse_straddling(run_dir, run, fp)
    job = start_job(run_dir, run, fp, determinism, provenance.read_sentinel(forward, device, images.shape[1:]))
    record = provenance.bin_record(fp, job["sentinel_start"])

    run["status"] = "running"
    run.pop("failure", None)
    write_json(run_dir / "run.json", run)
    # The bin is the unit of twin validity: if any arm of it is missing, measure all of its arms
    # again, back to back in this process, rather than pair stores from two processes.
    todo = [b for b in run["bins"] if not all(bin_done(run_dir, b, a.name) for a in arms)]
    if len(todo) < len(run["bins"]):
        print(f"twinrun: resuming: {len(run['bins']) - len(todo)} of {len(run['bins'])} bins already measured",
              flush=True)
    progress = Progress(len(todo) * len(arms))
    for b in todo:
        sigma = b["sigma"]
        t0 = time.perf_counter()
        eps = draws.noise(cfg["seed"], sigma, image_ids, p["n_draws"], tuple(images.shape[1:]))
        timings = []
        for arm in arms:
            t_arm = time.perf_counter()
            eps_dev = eps.to(device)
            sigma_cond = interventions[arm.name].sigma_cond(torch.tensor(sigma, dtype=torch.float32))
            try:
                sums = trial.as_model_error(arm.name, b, probe.fold_sums, model, names, images, eps_dev, sigma,
                                            sigma_cond.to(device), fold_of_image, len(sizes), p["chunk_images"],
                                            p["chunk_draws"], method=method, forward=forward)
                probe.check_finite(sums, arm.name, b["index"], sigma)
                meta = {"arm": arm.name, "bin_index": b["index"], "sigma": sigma,
                        "sigma_cond": float(sigma_cond), "n_images": p["n_images"], "n_draws": p["n_draws"],
                        "fold_sizes": sizes, "image_ids": image_ids, "seed": cfg["seed"],
                        "draws_digest": draws.digest(eps_dev, sigma), "config_hash": hashes[arm.name],
                        "layout": layout, "env": record, "kernel_path": fp["kernel_path"]}
                entry = b["stores"][arm.name]
                entry["sha256"] = write_store(run_dir / "arms" / arm.name / entry["file"], sums, meta)
                entry["status"] = "done"
                entry["kernel_path_sha256"] = record["kernel_path_sha256"]
                write_json(run_dir / "run.json", run)
            except Exception as err:  # any failure, ours or the model's: record where, keep earlier bins, re-raise
                _mark_failed(run_dir, run, b, arm.name, err)
                raise
            timings.append(f"{arm.name} {time.perf_counter() - t_arm:.2f}s")
            progress.step(f"bin {b['index'] + 1}/{len(run['bins'])} σ={sigma:g} {arm.name}")
        progress.log(f"bin {b['index'] + 1}/{len(run['bins'])} σ={sigma:g}: {', '.join(timings)} "
                     f"({time.perf_counter() - t0:.2f}s)")
    progress.close()
    job["sentinel_end"] = provenance.read_sentinel(forward, device, images.shape[1:])["digest"]
    run["status"] = "measured"
    write_json(run_dir / "run.json", run)
    return run


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


def start_job(run_dir: Path, run: dict, fp: dict, determinism: dict, sentinel: dict) -> dict:
    """Record this job (a first run, a resume or a requeue) in run.json and its fingerprint in env/."""
    (run_dir / "env").mkdir(exist_ok=True)
    sha = provenance.kernel_path_sha256(fp)
    if not (run_dir / "env" / f"kernel_path-{sha[:12]}.json").is_file():
        write_json(run_dir / "env" / f"kernel_path-{sha[:12]}.json", fp)
    jobs = run.setdefault("jobs", [])
    job = {"index": len(jobs), "kernel_path_sha256": provenance.kernel_path_sha256(fp),
           "hostname": fp["info"].get("hostname"), "boot_id": fp["info"].get("boot_id"),
           "slurm_job_id": (fp["info"].get("slurm") or {}).get("SLURM_JOB_ID"),
           "sentinel_start": sentinel["digest"], "sentinel_end": None}
    write_json(run_dir / "env" / f"job{job['index']:03d}.json",
               {"fingerprint": fp, "determinism": determinism, "sentinel": sentinel})
    jobs.append(job)
    return job


def _mark_failed(run_dir: Path, run: dict, b: dict, arm: str, err: BaseException | None = None) -> None:
    """Record which arm and bin failed; best effort (on a full disk run.json may not be writable)."""
    b["stores"][arm]["status"] = "failed"
    run["status"] = "failed"
    run["failure"] = {"arm": arm, "bin_index": b["index"], "sigma": b["sigma"], **trial.failure_record(err)}
    try:
        write_json(run_dir / "run.json", run)
    except StoreError as write_err:
        print(f"twinrun: could not record the failure in run.json: {write_err}")
