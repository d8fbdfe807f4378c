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

Nothing here depends on the clock, so a fingerprint is stable within a process. Reading GPU
properties initialises CUDA: call `twinrun.provenance.determinism.apply_determinism` first.
"""

import hashlib
import importlib.metadata
import os
import platform
import re
import shutil
import socket
import subprocess
from pathlib import Path

import torch

from twinrun.provenance.compile_cache import CACHE_ENV, autotune_choices, compile_caches

# Variables read by cuBLAS, OpenMP, MKL, OpenBLAS, oneDNN or ATen that change which kernels run.
NUMERICS_ENV = (
    "ATEN_CPU_CAPABILITY",
    "CUBLAS_WORKSPACE_CONFIG",
    "DNNL_MAX_CPU_ISA",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_NUM_THREADS",
    "NVIDIA_TF32_OVERRIDE",
    "OMP_NUM_THREADS",
    "ONEDNN_MAX_CPU_ISA",
    "OPENBLAS_CORETYPE",
    "OPENBLAS_NUM_THREADS",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "TORCH_BLAS_PREFER_CUBLASLT",
    "TORCH_BLAS_PREFER_HIPBLASLT",
    "DISABLE_ADDMM_CUDA_LT",  # addmm (a linear's bias epilogue) through cuBLASLt or plain cuBLAS
    "DISABLE_ADDMM_HIP_LT",
)
# Families of variables that choose kernels: Inductor and Triton; TunableOp (PYTORCH_TUNABLEOP_*: GEMMs
# tuned at run time, winners in a results file); cuBLAS/cuBLASLt (workspace sizes: other algorithms);
# cuDNN (TORCH_CUDNN_* heuristics mode and plan cache, CUDNN_* the library's own).
NUMERICS_ENV_PREFIXES = ("TORCHINDUCTOR_", "TRITON_", "PYTORCH_TUNABLEOP_", "CUBLAS_", "CUBLASLT_", "CUDNN_",
                         "TORCH_CUDNN_")
# Installed packages (normalised names, prefixes) that choose the kernels a probe runs. peft: a LoRA
# adapter's layers are peft's (its forward, merge and scaling arithmetic), as a network's are diffusers'.
NUMERICS_PACKAGES = ("torch", "triton", "pytorch-triton", "nvidia-", "cuda-", "diffusers", "peft", "xformers",
                     "flash-attn", "transformers", "accelerate", "numpy", "safetensors", "intel-openmp",
                     "mkl")
# Inductor exports these itself on first compile; their resolved paths are read separately.
ISA_FLAG = re.compile(r"avx|sse|amx|fma|f16c|vnni|bf16|fp16|asimd|sve|neon")
SLURM_ENV = (
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_NODEID",
    "SLURMD_NODENAME",
    "SLURM_RESTART_COUNT",
)


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


# --- kernel path -------------------------------------------------------------------------


def _torch_build(packages: dict) -> dict:
    return {
        "version": torch.__version__,
        "git_version": torch.version.git_version,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        # Runtime cuBLAS/Triton come from wheels when torch does; a source build leaves them null.
        "cublas": _first_version(packages, "nvidia-cublas"),
        "triton": _first_version(packages, "triton", "pytorch-triton"),
        # By name, every installed package whose kernels the probe may run: CUDA libraries from
        # wheels, compilers, and model libraries (another diffusers release, another attention).
        "packages": {n: v for n, v in sorted(packages.items()) if n.startswith(NUMERICS_PACKAGES)},
    }


def _gpu(device: torch.device | None) -> dict | None:
    """The measuring GPU: the kernels cuBLAS and cuDNN pick depend on its architecture and SM count."""
    if device is None or device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "sm_count": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}"}


def _cpu() -> dict:
    model, flags = None, []
    for line in (_read_text("/proc/cpuinfo") or "").splitlines():  # the first core speaks for all
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = value.split()
    model = model or platform.processor() or None
    isa = sorted({f for f in flags if ISA_FLAG.search(f)})
    return {
        "model": model,
        "isa_flags_sha256": _sha256(" ".join(isa)) if isa else None,
        "isa_flags_count": len(isa),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
    }


def _threads() -> dict:
    parallel = torch.__config__.parallel_info()
    return {
        "intra_op": torch.get_num_threads(),
        "inter_op": torch.get_num_interop_threads(),
        "omp_max": _int_or_none(_search(r"omp_get_max_threads\(\) : (\d+)", parallel)),
        "mkl_max": _int_or_none(_search(r"mkl_get_max_threads\(\) : (\d+)", parallel)),
    }


def _backend() -> dict:
    show = torch.__config__.show()
    settings = dict(
        item.split("=", 1)
        for item in (_search(r"Build settings: (.*)", show) or "").split(", ")
        if "=" in item
    )
    mkldnn = re.search(r"MKL-DNN v(\S+) \(Git Hash (\w+)\)", show)
    return {
        "blas": settings.get("BLAS_INFO"),
        "lapack": settings.get("LAPACK_INFO"),
        "mkl": _search(r"Math Kernel Library Version (\S+)", show),
        "mkldnn": f"{mkldnn.group(1)}+{mkldnn.group(2)}" if mkldnn else None,
        "openmp": _search(r"OpenMP (\d+)", show),
        "openblas": "open" in settings.get("BLAS_INFO", "").lower(),
        "use": {
            k: settings.get(k)
            for k in ("USE_CUDA", "USE_CUDNN", "USE_MKL", "USE_MKLDNN", "USE_OPENMP", "USE_ROCM")
        },
        "parallel": _search(r"ATen parallel backend: (.+)", torch.__config__.parallel_info()),
    }


def _switches() -> dict:
    cuda, cudnn, mkldnn = torch.backends.cuda, torch.backends.cudnn, torch.backends.mkldnn
    switches = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "float32_matmul_precision": _read(torch.get_float32_matmul_precision),
        "cuda_matmul_allow_tf32": _read(lambda: cuda.matmul.allow_tf32),
        "cuda_matmul_allow_fp16_reduced_precision_reduction": _read(
            lambda: cuda.matmul.allow_fp16_reduced_precision_reduction
        ),
        "cuda_matmul_allow_bf16_reduced_precision_reduction": _read(
            lambda: cuda.matmul.allow_bf16_reduced_precision_reduction
        ),
        "cuda_matmul_allow_fp16_accumulation": _read(lambda: cuda.matmul.allow_fp16_accumulation),
        "cuda_preferred_blas_library": _read(lambda: cuda.preferred_blas_library()),
        "cudnn_enabled": cudnn.enabled,
        "cudnn_allow_tf32": _read(lambda: cudnn.allow_tf32),
        "cudnn_benchmark": cudnn.benchmark,
        "cudnn_deterministic": cudnn.deterministic,
        "cuda_tunableop_enabled": _read(_tunableop_enabled),
        "mkldnn_enabled": mkldnn.enabled,
        "mkldnn_deterministic": _read(lambda: mkldnn.deterministic),
    }
    # The newer per-backend precision API (torch >= 2.9); both APIs are read because either may be set.
    for name, obj in (
        ("generic", torch.backends),
        ("cuda_matmul", cuda.matmul),
        ("cudnn", cudnn),
        ("cudnn_conv", getattr(cudnn, "conv", None)),
        ("cudnn_rnn", getattr(cudnn, "rnn", None)),
        ("mkldnn", mkldnn),
        ("mkldnn_matmul", getattr(mkldnn, "matmul", None)),
        ("mkldnn_conv", getattr(mkldnn, "conv", None)),
        ("mkldnn_rnn", getattr(mkldnn, "rnn", None)),
    ):
        if obj is not None and hasattr(obj, "fp32_precision"):
            switches[f"fp32_precision_{name}"] = _read(lambda obj=obj: obj.fp32_precision)
    for sdp in ("flash", "mem_efficient", "math", "cudnn"):
        getter = getattr(cuda, f"{sdp}_sdp_enabled", None)
        if getter is not None:
            switches[f"sdp_{sdp}"] = _read(getter)
    if hasattr(cuda, "fp16_bf16_reduction_math_sdp_allowed"):
        switches["sdp_math_fp16_bf16_reduction"] = _read(cuda.fp16_bf16_reduction_math_sdp_allowed)
    return switches


def _tunableop_enabled():
    """TunableOp tunes GEMMs at run time and replays the winners from a results file (CUDA/ROCm)."""
    tunable = getattr(torch.cuda, "tunable", None)
    return None if tunable is None or not torch.cuda.is_available() else tunable.is_enabled()


def _inductor_knobs() -> dict:
    import torch._inductor.config as inductor  # imported only for compiled runs: it costs ~1.5 s
    import torch.compiler.config as compiler

    names = (
        "deterministic",
        "batch_invariant",
        "max_autotune",
        "max_autotune_gemm",
        "max_autotune_pointwise",
        "coordinate_descent_tuning",
        "fx_graph_cache",
        "autotune_local_cache",
        "autotune_remote_cache",
        "fallback_random",
    )
    knobs = {name: _jsonable(getattr(inductor, name)) for name in names if hasattr(inductor, name)}
    knobs["triton.cudagraphs"] = _jsonable(getattr(inductor.triton, "cudagraphs", None))
    knobs["triton.cudagraph_trees"] = _jsonable(getattr(inductor.triton, "cudagraph_trees", None))
    knobs["force_disable_caches"] = _jsonable(getattr(compiler, "force_disable_caches", None))
    return knobs


def _mode_options(mode: str) -> dict:
    """Inductor's options for a torch.compile mode, as torch.compile applies them (read from torch, not
    restated: `max-autotune` is max_autotune, coordinate_descent_tuning and triton.cudagraphs)."""
    # _inductor_knobs imported torch._inductor.config, so its package is loaded: no import needed here.
    options = torch._inductor.list_mode_options(mode)
    return {name: _jsonable(value) for name, value in sorted(options.items())}


def _numerics_env() -> dict:
    env = {name: os.environ.get(name) for name in NUMERICS_ENV}
    for name, value in os.environ.items():
        if name.startswith(NUMERICS_ENV_PREFIXES) and name not in CACHE_ENV:
            env[name] = value
    return dict(sorted(env.items()))


# --- info --------------------------------------------------------------------------------


def _gpu_uuids() -> list | None:
    if not torch.cuda.is_available():
        return None
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def _gpu_uuid(device: torch.device | None) -> str | None:
    if device is None or device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def _nvidia_smi() -> list | None:
    """Every GPU on the node (not only the visible ones) with its UUID and driver; None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    query = "--query-gpu=index,uuid,driver_version,name"
    try:
        out = subprocess.run(
            [exe, query, "--format=csv,noheader"], check=False, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    rows = [[field.strip() for field in line.split(",")] for line in out.stdout.strip().splitlines()]
    return [dict(zip(("index", "uuid", "driver_version", "name"), row)) for row in rows if len(row) == 4]


def _git_state() -> dict:
    """Commit and dirty state of the checkout holding this package; nulls outside a git checkout."""
    package = Path(__file__).resolve().parent.parent
    state = {"commit": None, "dirty": None}

    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(
                ["git", "-C", str(package.parent), *args],
                check=False,
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None

    top = git("rev-parse", "--show-toplevel")
    if top is None or top.returncode != 0:
        return state
    # An install inside an ignored venv of some other checkout is not that checkout's source.
    ignored = git("check-ignore", "-q", str(package))
    if ignored is None or ignored.returncode == 0:
        return state
    head = git("rev-parse", "HEAD")  # fails in a repository with no commits yet
    if head is not None and head.returncode == 0:
        state["commit"] = head.stdout.strip()
    status = git("status", "--porcelain")
    if status is not None and status.returncode == 0:
        state["dirty"] = bool(status.stdout.strip())
    return state


# --- helpers -----------------------------------------------------------------------------


def _installed_packages() -> dict:
    packages = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            packages[re.sub(r"[-_.]+", "-", name).lower()] = dist.version
    return packages


def _first_version(packages: dict, *prefixes: str) -> str | None:
    hits = sorted(f"{n}=={v}" for n, v in packages.items() if n.startswith(prefixes))
    return ";".join(hits) or None


def _read(getter):
    """A flag's value; torch raises on some reads (e.g. after mixing the legacy and new TF32 APIs)."""
    try:
        return _jsonable(getter())
    except (RuntimeError, AttributeError) as err:
        return f"unreadable: {type(err).__name__}: {str(err)[:80]}"


def _jsonable(value):
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _search(pattern: str, text: str) -> str | None:
    match = re.search(pattern, text)
    return match.group(1).strip() if match else None


def _int_or_none(text: str | None) -> int | None:
    return None if text is None else int(text)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


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
