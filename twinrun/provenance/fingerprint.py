"""Environment fingerprint: which kernel path produced a number, and where it ran (a leaf: torch only).

`python -m twinrun.env` prints the fingerprint a run made here records, with its digest.

`fingerprint()` splits what it reads in two:

- `kernel_path` must match for two numbers to be comparable bit for bit. Each field can move
  floating-point results by choosing a different kernel or summation order:
  torch/CUDA/cuDNN/cuBLAS/Triton versions (different kernels and heuristics); the measuring GPU's
  name, SM count and capability (cuBLAS is reproducible only on the same architecture and SM
  count, so MIG slices differ; the other GPUs the process sees choose nothing); CPU model,
  vector-ISA flags and ATen's CPU capability (AVX2 vs AVX512 kernels reduce in different orders);
  thread counts (reductions and some BLAS calls split work per thread); BLAS/oneDNN/OpenMP backend
  and versions; the numerics switches (deterministic
  algorithms, TF32, reduced-precision reductions, cuDNN benchmark, SDPA backends, TunableOp);
  whether and how torch.compile runs (the options its mode turns on, CUDA graphs among them, and
  Inductor's knobs, its deterministic mode among them) and the content of its caches (they hold
  autotune winners); environment variables that those libraries read (the CUDA ones that choose
  GEMM and convolution kernels too).
- `info` is recorded, never compared: host, boot, kernel, Python, GPU UUIDs and driver, SLURM
  ids, the twinrun git commit, a digest of installed packages, pid. Two arms on the same path
  may legitimately differ here (e.g. a requeue to another node with identical hardware).

The readers live in rooms of their own: `machine.py` (torch's build, GPU, CPU, threads, backend),
`switches.py` (numerics switches, Inductor's knobs, the libraries' variables), `host.py` (info).

Nothing here depends on the clock, so a fingerprint is stable within a process. Reading GPU
properties initialises CUDA: call `twinrun.provenance.determinism.apply_determinism` first.
"""

import hashlib
import os
import platform
import socket
from pathlib import Path

import torch

from twinrun.provenance.compile_cache import autotune_choices, compile_caches
from twinrun.provenance.host import SLURM_ENV, _git_state, _gpu_uuid, _gpu_uuids, _nvidia_smi
from twinrun.provenance.machine import (
    _backend,
    _cpu,
    _gpu,
    _installed_packages,
    _read_text,
    _sha256,
    _threads,
    _torch_build,
)
from twinrun.provenance.switches import _inductor_knobs, _mode_options, _numerics_env, _switches


def fingerprint(compile_mode: str | None = None, device: torch.device | str | None = None) -> dict:
    """This process's kernel path (compared) and provenance (recorded); see the module docstring.

    `compile_mode` is the torch.compile mode the caller uses (None = eager). Only when it is set do
    Inductor's knobs and cache contents join the kernel path: eager numbers never read them.
    `device` is where the numbers are computed: a GPU's model and SM count join the kernel path (the
    other GPUs the process sees do not); None or the CPU: no GPU.
    """
    packages = _installed_packages()
    device = None if device is None else torch.device(device)
    compile_path = {"used": compile_mode is not None, "mode": compile_mode}
    if compile_mode is not None:
        # Before reading the caches: importing Inductor creates its default cache dir.
        compile_path["inductor"] = _inductor_knobs()
        # What the mode turns on for its compiles (max-autotune: CUDA graphs and autotuning), and the
        # knobs those compiles then run with: Inductor's deterministic mode (on with deterministic
        # algorithms since torch 2.10) skips autotuning, so "max-autotune" may not autotune at all.
        compile_path["mode_options"] = _mode_options(compile_mode)
        compile_path["effective"] = {**compile_path["inductor"], **compile_path["mode_options"]}
    caches = compile_caches()
    if compile_mode is not None:
        compile_path["caches"] = {name: entry["digest"] for name, entry in caches.items()}
        compile_path["autotune_choices"] = autotune_choices(caches)
    kernel_path = {
        "torch": _torch_build(packages),
        "gpu": _gpu(device),
        "cpu": _cpu(),
        "threads": _threads(),
        "backend": _backend(),
        "switches": _switches(),
        "compile": compile_path,
        "env": _numerics_env(),
        # The code that computes the numbers: an edit to the probe moves results as surely as a
        # library upgrade, and the git commit (info) misses uncommitted edits.
        "twinrun_sources_sha256": _twinrun_sources_sha256(),
    }
    info = {
        "hostname": socket.gethostname(),
        "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gpu_uuids": _gpu_uuids(),
        "device": None if device is None else str(device),
        "device_uuid": _gpu_uuid(device),
        "nvidia_smi": _nvidia_smi(),
        "slurm": {name: os.environ.get(name) for name in SLURM_ENV},
        "git": _git_state(),
        "packages_sha256": _sha256("\n".join(f"{n}=={v}" for n, v in sorted(packages.items()))),
        "packages_count": len(packages),
        "compile_caches": caches,
    }
    return {"kernel_path": kernel_path, "info": info}


def _twinrun_sources_sha256() -> str:
    """sha256 over twinrun's own .py files (relative path + content), in path order."""
    root = Path(__file__).resolve().parent.parent  # the twinrun package, not this folder
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def kernel_path_diff(a: dict, b: dict) -> list[str]:
    """Dotted names of kernel-path fields that differ; takes fingerprints or their kernel_path parts."""
    flat_a = _flatten(a.get("kernel_path", a))
    flat_b = _flatten(b.get("kernel_path", b))
    missing = object()
    return sorted(
        k for k in flat_a.keys() | flat_b.keys() if flat_a.get(k, missing) != flat_b.get(k, missing)
    )


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        return {prefix: tree}
    flat = {}
    for key, value in items:
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    if not flat and prefix:  # an empty dict/list is a value of its own (e.g. no GPUs)
        flat[prefix] = tree
    return flat


def kernel_path_fields(a: dict, b: dict) -> list[str]:
    """The kernel-path fields in which two compared sides ({unit: store}) differ, by their first stores'
    records (none: one kernel path)."""
    ma, mb = next(iter(a.values())).meta, next(iter(b.values())).meta
    sha_a = (ma.get("env") or {}).get("kernel_path_sha256")
    sha_b = (mb.get("env") or {}).get("kernel_path_sha256")
    if sha_a is not None and sha_a == sha_b and ma.get("kernel_path") == mb.get("kernel_path"):
        return []
    return (kernel_path_diff(ma.get("kernel_path") or {}, mb.get("kernel_path") or {})
            or ["kernel_path_sha256"])
