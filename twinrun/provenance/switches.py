"""The switches that choose kernels, as the kernel path records them: torch's numerics switches, the
knobs Inductor compiles with and what a torch.compile mode turns on, and the environment variables the
numerics libraries read (twinrun/provenance/fingerprint.py says why each can move bits)."""

import os

import torch

from twinrun.provenance.compile_cache import CACHE_ENV

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


def _read(getter):
    """A flag's value; torch raises on some reads (e.g. after mixing the legacy and new TF32 APIs)."""
    try:
        return _jsonable(getter())
    except (RuntimeError, AttributeError) as err:
        return f"unreadable: {type(err).__name__}: {str(err)[:80]}"


def _jsonable(value):
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
