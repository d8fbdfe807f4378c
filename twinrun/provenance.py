"""What every job records about where it ran: fingerprint, sentinel, determinism, per-bin record.

The per-bin record is what the reducer compares between the arms of a bin (validity rule 3: one
process, one node, one boot, one GPU, one kernel path, sentinel unchanged around the pair).
"""

import hashlib
import json
from pathlib import Path

import torch

from twinrun.config import DeterminismConfig, ProbeConfig, typed
from twinrun.determinism import apply_determinism
from twinrun.env import kernel_path_diff
from twinrun.errors import EXIT_REFUSED, StoreError, TwinrunError
from twinrun.rundir import RunIndex
from twinrun.sentinel import sentinel
from twinrun.store import read_json


class KernelPathRefused(TwinrunError):
    """Twins or comparisons must not straddle kernel paths (exit 3)."""

    exit_code = EXIT_REFUSED

    @property
    def record(self) -> dict:
        """run.json's failure fields when a job refuses (the launcher then reports exit 3)."""
        return {"refused": "kernel_path"}


def kernel_path_sha256(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp["kernel_path"], sort_keys=True).encode()).hexdigest()


def default_compile_cache_dir() -> str:
    return str(Path.home() / ".cache" / "twinrun" / "compile")


def probe_arithmetic(p: ProbeConfig, method: str, device: str) -> dict:
    """The probe settings that change the arithmetic of a store, not what it measures: they join the
    kernel path (a resume or a reference under other settings is another path). `method` is the
    resolved one (vmap | folds), never `auto`, and so is `device` (cpu | cuda)."""
    return {"method": method, "compile": p.compile or False, "device": device,  # null compile is eager
            "chunk_images": p.chunk_images, "chunk_draws": p.chunk_draws}


def setup_determinism(cfg: dict) -> dict:
    """Apply the run's determinism settings first thing in the job; return the record. Keys the
    config lacks take the schema's defaults (twinrun.config.DeterminismConfig)."""
    d = typed(DeterminismConfig, cfg["determinism"], "determinism")
    return apply_determinism(d.enabled, d.compile_cache_dir or default_compile_cache_dir(),
                             d.float32_matmul_precision)


def model_sentinel_fn(model: torch.nn.Module, device: torch.device, image_shape: tuple):
    """The probed model's own forward and backward on a fixed input (batch of 8: batch sizes of
    1–5 take another kernel path than ≥ 6 on CPU), for the sentinel battery."""

    def run():
        x = torch.randn((8, *image_shape), generator=torch.Generator().manual_seed(1234)).to(device)
        sigma = torch.full((8,), 0.5, device=device)
        params = [p for p in model.parameters() if p.requires_grad]
        out = model(x, sigma, sigma)
        grads = torch.autograd.grad(out.square().mean(), params, allow_unused=True)
        return (out.detach(), *(g for g in grads if g is not None))

    return run


def read_sentinel(model: torch.nn.Module, device: torch.device, image_shape: tuple) -> dict:
    return sentinel(model_sentinel_fn(model, device, tuple(image_shape)), device=device)


def bin_record(fp: dict, sentinel_digest: str) -> dict:
    """Where a bin's pair ran: equal for every arm of the bin, or the bin is not a twin."""
    info = fp["info"]
    slurm = info.get("slurm") or {}
    return {
        "kernel_path_sha256": kernel_path_sha256(fp),
        "hostname": info.get("hostname"),
        "boot_id": info.get("boot_id"),
        "pid": info.get("pid"),
        "gpu_uuids": info.get("gpu_uuids"),
        "slurm_job_id": slurm.get("SLURM_JOB_ID"),
        "slurm_array_job_id": slurm.get("SLURM_ARRAY_JOB_ID"),
        "slurm_array_task_id": slurm.get("SLURM_ARRAY_TASK_ID"),
        "slurm_restart_count": slurm.get("SLURM_RESTART_COUNT"),
        "sentinel": sentinel_digest,
    }


def refuse_straddling(index: RunIndex, fp: dict, todo: list[dict]) -> None:
    """A resume on another kernel path than the finished bins is refused: twins must not straddle.

    Judged on the whole bins (every arm's store recorded done: each entry records its kernel path),
    not on whichever job came first or on a bin cut short: a job that finished nothing commits the
    run to nothing. A job with no bin to measure (`todo` empty) measures nothing, so refuses nothing.
    """
    if not todo:
        return
    mine = kernel_path_sha256(fp)
    others = {e.get("kernel_path_sha256") for b in index.whole_bins(verify=False)
              for e in b["stores"].values()} - {mine, None}
    if not others:
        return
    path = index.run_dir.kernel_path_env(min(others))
    try:
        fields = kernel_path_diff(read_json(path), fp)
    except StoreError:  # missing or damaged: the refusal stands, its detail is unknown
        fields = ["(unrecorded)"]
    raise KernelPathRefused(
        f"{index.run_dir.path}: its finished bins were measured on another kernel path (differs in "
        f"{', '.join(fields) or 'kernel_path'}); twins must not straddle environments: resume it where it "
        "started, or start a new run directory"
    )
