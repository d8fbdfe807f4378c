"""What every job records about where it ran: fingerprint, sentinel, determinism, per-bin record.

The per-bin record is what the reducer compares between the arms of a bin (validity rule 3: one
process, one node, one boot, one GPU, one kernel path, sentinel unchanged around the pair).
"""

import hashlib
import json
from pathlib import Path

import torch

from twinrun.determinism import apply_determinism
from twinrun.env import kernel_path_diff
from twinrun.errors import EXIT_REFUSED, TwinrunError
from twinrun.sentinel import sentinel


class KernelPathRefused(TwinrunError):
    """Twins or comparisons must not straddle kernel paths (exit 3)."""

    exit_code = EXIT_REFUSED


def kernel_path_sha256(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp["kernel_path"], sort_keys=True).encode()).hexdigest()


def default_compile_cache_dir() -> str:
    return str(Path.home() / ".cache" / "twinrun" / "compile")


def probe_arithmetic(probe: dict) -> dict:
    """The probe settings that change the arithmetic of a store, not what it measures: they join the
    kernel path (a resume or a reference under other settings is another path). `method` must be
    resolved (vmap | folds), never `auto`, and so must `device` (cpu | cuda)."""
    return {"method": probe["method"], "compile": probe.get("compile") or False, "device": probe.get("device"),
            "chunk_images": probe["chunk_images"], "chunk_draws": probe["chunk_draws"]}


def setup_determinism(cfg: dict) -> dict:
    """Apply the run's determinism settings first thing in the job; return the record."""
    d = cfg.get("determinism", {})
    return apply_determinism(bool(d.get("enabled", True)), d.get("compile_cache_dir") or default_compile_cache_dir(),
                             d.get("float32_matmul_precision", "highest"))


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


def refuse_straddling(run_dir: Path, run: dict, fp: dict) -> None:
    """A resume on another kernel path than the finished bins is refused: twins must not straddle.

    Judged on the bins actually finished (each run.json store entry records its kernel path), not on
    whichever job came first: a job that finished nothing commits the run to nothing.
    """
    mine = kernel_path_sha256(fp)
    others = {e.get("kernel_path_sha256") for b in run["bins"] for e in b["stores"].values()
              if e.get("status") == "done"} - {mine, None}
    if not others:
        return
    path = run_dir / "env" / f"kernel_path-{min(others)[:12]}.json"
    fields = kernel_path_diff(json.loads(path.read_text()), fp) if path.is_file() else ["(unrecorded)"]
    raise KernelPathRefused(
        f"{run_dir}: its finished bins were measured on another kernel path (differs in "
        f"{', '.join(fields) or 'kernel_path'}); twins must not straddle environments: resume it where it "
        "started, or start a new run directory"
    )
