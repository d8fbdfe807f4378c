"""What every job records about where it ran: determinism, sentinel, the per-unit record, and the
straddling rule (a run's units never span two kernel paths).

The per-unit record is what the reducer compares between the arms of a unit (validity rule 3: one
process, one node, one boot, one GPU, one kernel path, sentinel unchanged around the pair). The
straddling rule is defined here once and handed to the run's index (twinrun.storage.rundir), which
applies it to run.json as it is at the moment a store is recorded.
"""

import hashlib
import json
import os
from pathlib import Path

import torch

from twinrun.config import DeterminismConfig
from twinrun.errors import KernelPathRefused, StoreError
from twinrun.files import read_json
from twinrun.instantiate import typed
from twinrun.provenance.compile_cache import run_cache_dir
from twinrun.provenance.determinism import apply_determinism
from twinrun.provenance.fingerprint import kernel_path_diff
from twinrun.provenance.sentinel import NOT_REPEATED_OFF, repeats_backward, sentinel


def tensors_sha256(named) -> str:
    """sha256 over (name, dtype, shape, bytes) of named tensors, in the order given."""
    h = hashlib.sha256()
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_sha256(model: torch.nn.Module) -> str:
    """What the model is, as built (weights loaded): every parameter and buffer, persistent or not.
    A weights file changed in place under the same path and config changes it."""
    buffers = (("buffer:" + n, b) for n, b in model.named_buffers())
    return tensors_sha256([*model.named_parameters(), *buffers])


SENTINEL_MODEL_SEED = 1234  # the generators' state for the sentinel's model op (fixed forever)


def kernel_path_sha256(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp["kernel_path"], sort_keys=True).encode()).hexdigest()


def default_compile_cache_dir() -> str:
    return str(Path.home() / ".cache" / "twinrun" / "compile")


def setup_determinism(cfg: dict, run_dir: Path | None = None) -> dict:
    """Apply the run's determinism settings first thing in the job; return the record. Keys the
    config lacks take the schema's defaults (twinrun.config.DeterminismConfig). With `run_dir`, the
    compile caches are that run's own, under determinism.compile_cache_dir (compile_cache.run_cache_dir)."""
    d = typed(DeterminismConfig, cfg["determinism"], "determinism")
    root = compile_cache_root(cfg)
    cache = root if run_dir is None else run_cache_dir(root, run_dir)
    return apply_determinism(d.enabled, cache, d.float32_matmul_precision)


def compile_cache_root(cfg: dict) -> str:
    """determinism.compile_cache_dir, or its default: where the runs' own compile caches live."""
    d = typed(DeterminismConfig, cfg["determinism"], "determinism")
    return os.path.expanduser(d.compile_cache_dir or default_compile_cache_dir())


def model_sentinel_fn(model: torch.nn.Module, device: torch.device, image_shape: tuple,
                      backward: bool = True):
    """The probed model's own forward and (with `backward`) backward on a fixed input (batch of 8: batch
    sizes of 1–5 take another kernel path than ≥ 6 on CPU), for the sentinel battery."""

    def run():
        x = torch.randn((8, *image_shape), generator=torch.Generator().manual_seed(1234)).to(device)
        sigma = torch.full((8,), 0.5, device=device)
        params = [p for p in model.parameters() if p.requires_grad]
        # A model probed in train mode may draw randomness (dropout): from a fixed state, so the op repeats.
        with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
            torch.manual_seed(SENTINEL_MODEL_SEED)
            with torch.set_grad_enabled(backward):
                out = model(x, sigma, sigma)
            if not backward:
                return out.detach()
            grads = torch.autograd.grad(out.square().mean(), params, allow_unused=True)
        return (out.detach(), *(g for g in grads if g is not None))

    return run


def read_sentinel(model: torch.nn.Module, device: torch.device, image_shape: tuple) -> dict:
    """The sentinel with the model's own op: forward and backward wherever the backward must repeat under
    the run's determinism setting; on CUDA with determinism off the forward only, and it says so."""
    backward = repeats_backward(device)
    reading = sentinel(model_sentinel_fn(model, device, tuple(image_shape), backward), device=device)
    if not backward:
        reading["skipped"]["model_backward"] = NOT_REPEATED_OFF
    return reading


def unit_record(fp: dict, sentinel_digest: str) -> dict:
    """Where a unit's arms ran: equal for every arm of the unit, or the unit is not a twin."""
    info = fp["info"]
    slurm = info.get("slurm") or {}
    return {
        "kernel_path_sha256": kernel_path_sha256(fp),
        "hostname": info.get("hostname"),
        "boot_id": info.get("boot_id"),
        "pid": info.get("pid"),
        "gpu_uuids": info.get("gpu_uuids"),
        "device_uuid": info.get("device_uuid"),
        "slurm_job_id": slurm.get("SLURM_JOB_ID"),
        "slurm_array_job_id": slurm.get("SLURM_ARRAY_JOB_ID"),
        "slurm_array_task_id": slurm.get("SLURM_ARRAY_TASK_ID"),
        "slurm_restart_count": slurm.get("SLURM_RESTART_COUNT"),
        "sentinel": sentinel_digest,
    }


def straddling_rule(run_dir: Path, kernel_path_file, fp: dict):
    """The rule `refuse(others, mine)`: a store measured on kernel path `mine` may not join a run whose
    whole units (each records its kernel path) were measured on another (`others`).

    Judged on the whole units, not on whichever job came first or on a unit cut short: a job that
    finished nothing commits the run to nothing. `kernel_path_file(sha)` names the recorded
    fingerprint of another path, for the refusal's list of fields that differ."""

    def refuse(others: set, mine: str) -> None:
        others = set(others) - {mine, None}
        if not others:
            return
        try:
            fields = kernel_path_diff(read_json(kernel_path_file(min(others))), fp)
        except StoreError:  # missing or damaged: the refusal stands, its detail is unknown
            fields = ["(unrecorded)"]
        raise KernelPathRefused(
            f"{run_dir}: its finished units were measured on another kernel path (differs in "
            f"{', '.join(fields) or 'kernel_path'}); twins must not straddle environments: resume it "
            "where it started, or start a new run directory")

    return refuse
