"""Determinism mode: pin torch's numerics switches so one kernel path repeats bit for bit.

This makes results repeatable within one kernel path. It cannot choose which path a fresh
environment takes: autotuner winners, library versions, GPU model and SM count, and thread count
all decide that, and a reboot, a wiped cache or another node may pick a different one. That is why
twinrun reads effects only against a twin measured on the same path (see docs/kernel-paths.md).

Call `apply_determinism` first thing, before any CUDA work (cuBLAS reads CUBLAS_WORKSPACE_CONFIG
once, when it first sets up) and before torch.compile (it binds its cache dirs on import).
"""

import os
import warnings

import torch

from twinrun.errors import ConfigError
from twinrun.provenance.compile_cache import default_inductor_cache_dir

MATMUL_PRECISIONS = ("highest", "high", "medium")
CUBLAS_WORKSPACE_CONFIG = ":4096:8"  # one of the two settings cuBLAS documents as deterministic


def apply_determinism(
    enabled: bool, compile_cache_dir: str | None, float32_matmul_precision: str = "highest"
) -> dict:
    """Pin the switches when `enabled`; return a record of what was found, set and changed.

    `float32_matmul_precision` decides TF32 for CUDA matmuls ("highest" = off); cuDNN TF32 is always
    turned off. `compile_cache_dir` moves the Inductor and Triton caches to a durable directory (the
    default lives in /tmp and vanishes on reboot, taking autotune winners with it) unless the user
    already pointed TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR elsewhere. Disabled, nothing changes
    and the record only reports current values.
    """
    if float32_matmul_precision not in MATMUL_PRECISIONS:
        raise ConfigError(
            "float32_matmul_precision",
            float32_matmul_precision,
            f"choose one of {', '.join(MATMUL_PRECISIONS)}",
        )
    found = _current()
    record = {
        "enabled": enabled,
        "cuda_initialized": torch.cuda.is_initialized(),
        "found": found,
        "set": {},
        "changed": [],
        "cublas_workspace_config_may_be_ignored": False,
    }
    if not enabled:
        return record

    # Step: environment read by cuBLAS and Inductor. First, and judged on what was found: the
    # next step imports torch._inductor.config, whose import exports the /tmp default cache dir.
    env = {}
    if found["CUBLAS_WORKSPACE_CONFIG"] is None:
        env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
        if record["cuda_initialized"]:
            warnings.warn(
                "CUBLAS_WORKSPACE_CONFIG set after CUDA was initialised; cuBLAS may ignore it. "
                "Call apply_determinism before any CUDA work.",
                stacklevel=2,
            )
    if compile_cache_dir is not None:
        durable = os.path.abspath(compile_cache_dir)
        for name, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
            if _not_chosen_by_user(found[name]):
                env[name] = os.path.join(durable, sub)
                os.makedirs(env[name], exist_ok=True)
    os.environ.update(env)

    # Step: torch and cuDNN switches.
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    # This also sets cuda.matmul.allow_tf32 (its legacy alias: off only for "highest") and oneDNN's
    # CPU matmul precision ("medium" = bf16). Setting allow_tf32 = False on top of "high" would
    # contradict the caller's choice, and torch then refuses to read the precision back.
    torch.set_float32_matmul_precision(float32_matmul_precision)
    torch.backends.cudnn.allow_tf32 = False

    after = _current()
    switches = (
        "deterministic_algorithms",
        "deterministic_warn_only",
        "cudnn_benchmark",
        "cudnn_deterministic",
        "float32_matmul_precision",
        "cuda_matmul_allow_tf32",
        "cudnn_allow_tf32",
    )
    record["set"] = {key: after[key] for key in (*switches, *env)}
    record["changed"] = sorted(key for key in after if after[key] != found[key])
    record["cublas_workspace_config_may_be_ignored"] = (
        "CUBLAS_WORKSPACE_CONFIG" in env and record["cuda_initialized"]
    )
    return record


def _current() -> dict:
    """The switches this module sets, as they stand now."""

    def read(getter):
        try:
            return getter()
        except RuntimeError as err:  # torch refuses some reads after the legacy and new TF32 APIs were mixed
            return f"unreadable: {str(err)[:80]}"

    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "float32_matmul_precision": read(torch.get_float32_matmul_precision),
        "cuda_matmul_allow_tf32": read(lambda: torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": read(lambda: torch.backends.cudnn.allow_tf32),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR"),
    }


def _not_chosen_by_user(cache_dir: str | None) -> bool:
    """Unset, or inside Inductor's /tmp default: importing torch._dynamo exports that itself."""
    if cache_dir is None:
        return True
    default = os.path.abspath(default_inductor_cache_dir())
    return os.path.commonpath([os.path.abspath(cache_dir), default]) == default
