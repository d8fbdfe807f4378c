"""Determinism mode: pin torch's numerics switches so one kernel path repeats bit for bit.

This makes results repeatable within one kernel path. It cannot choose which path a fresh
environment takes: autotuner winners, library versions, GPU model and SM count, and thread count
all decide that, and a reboot, a wiped cache or another node may pick a different one. That is why
twinrun reads effects only against a twin measured on the same path (see docs/kernel-paths.md).

Call `apply_determinism` first thing, before any CUDA work (cuBLAS reads CUBLAS_WORKSPACE_CONFIG
once, when it first sets up) and before torch.compile (it binds its cache dirs on import).
"""

import os
import sys
import warnings
from contextlib import contextmanager

import torch

from twinrun.errors import ConfigError
from twinrun.provenance.compile_cache import (
    CACHE_ENV,
    default_inductor_cache_dir,
    is_twinrun_cache,
    mark_twinrun_cache,
)

MATMUL_PRECISIONS = ("highest", "high", "medium")
CUBLAS_WORKSPACE_CONFIG = ":4096:8"  # one of the two settings cuBLAS documents as deterministic
DETERMINISTIC_CUBLAS_WORKSPACE_CONFIGS = (":4096:8", ":16:8")


def apply_determinism(
    enabled: bool, compile_cache_dir: str | None, float32_matmul_precision: str = "highest"
) -> dict:
    """Pin the switches when `enabled`; return a record of what was found, set and changed.

    `float32_matmul_precision` decides TF32 for CUDA matmuls ("highest" = off); cuDNN TF32 is always
    turned off. `compile_cache_dir` moves the Inductor and Triton caches to a durable directory (the
    default lives in /tmp and vanishes on reboot, taking autotune winners with it) unless the user
    already pointed TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR elsewhere; it does so enabled or not
    (the caches' digest is part of the kernel path either way). Disabled, no switch changes and the
    record only reports their current values.
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
    # Step: the compile caches, whatever determinism says (their digest is part of the kernel path
    # either way). First, and judged on what was found: the next steps import torch._inductor.config,
    # whose import exports the /tmp default cache dir.
    caches = _cache_env(compile_cache_dir, found)
    os.environ.update(caches)
    _forget_cache_paths(caches)
    record["compile_caches"] = caches
    if not enabled:
        return record

    # Step: environment read by cuBLAS, before CUDA's first use.
    env = {}
    if found["CUBLAS_WORKSPACE_CONFIG"] is None:
        env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
        if record["cuda_initialized"]:
            warnings.warn(
                "CUBLAS_WORKSPACE_CONFIG set after CUDA was initialised; cuBLAS may ignore it. "
                "Call apply_determinism before any CUDA work.",
                stacklevel=2,
            )
    os.environ.update(env)
    # A value the user set is kept; cuBLAS is deterministic only under the two it documents.
    record["cublas_workspace_config_deterministic"] = (
        os.environ["CUBLAS_WORKSPACE_CONFIG"] in DETERMINISTIC_CUBLAS_WORKSPACE_CONFIGS)

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
    record["set"] = {key: after[key] for key in (*switches, *env, *caches)}
    record["changed"] = sorted(key for key in after if after[key] != found[key])
    record["cublas_workspace_config_may_be_ignored"] = (
        "CUBLAS_WORKSPACE_CONFIG" in env and record["cuda_initialized"]
    )
    return record


def _cache_env(compile_cache_dir: str | None, found: dict) -> dict:
    """TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR under `compile_cache_dir`, unless the user chose them."""
    if compile_cache_dir is None:
        return {}
    env, durable = {}, os.path.abspath(compile_cache_dir)
    for name, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        if _not_chosen_by_user(found[name]):
            env[name] = os.path.join(durable, sub)
            os.makedirs(env[name], exist_ok=True)
    if env:
        mark_twinrun_cache(durable)
    return env


def _forget_cache_paths(caches: dict) -> None:
    """Inductor memoizes paths under its cache dir for the life of the process (the autotune timings'
    `cache/<system>` file among them): when a process already imported it and now compiles for another
    run (a local sweep's next point), those paths are cleared, else that run would read and write the
    first run's autotune timings. Inductor's own `fresh_cache()` clears the same registry."""
    inductor_utils = sys.modules.get("torch._inductor.utils")
    if caches and inductor_utils is not None:
        inductor_utils.clear_caches()


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
    """Unset, inside Inductor's /tmp default (importing torch._dynamo exports that itself), or a cache
    twinrun chose: an earlier run's own (a local sweep runs its points' jobs in one process), or the shared
    one of an eager job, inherited by a child process (a compiled run there took it for the user's and
    compiled into a cache every such run shared: a cold recompile then read the first run's kernels)."""
    if cache_dir is None or is_twinrun_cache(cache_dir):
        return True
    default = os.path.abspath(default_inductor_cache_dir())
    return os.path.commonpath([os.path.abspath(cache_dir), default]) == default


@contextmanager
def switches_kept(builder: str, restore: bool):
    """Around one builder of the run (model, data, an intervention), which may run after determinism was
    applied: a switch it changed (TF32, cuDNN benchmarking, deterministic algorithms …) is named in one
    line and, with `restore` (determinism.enabled=true), set back before anything is measured."""
    before = _current()
    yield
    after = _current()
    changed = [key for key in before if after[key] != before[key]]
    if restore and changed:
        _restore(before)
    # A compile cache directory is no numerics switch: importing diffusers (torch._dynamo) exports
    # Inductor's default one, which changes no arithmetic; only one a builder chose itself is named.
    changed = [key for key in changed if key not in CACHE_ENV or not _not_chosen_by_user(after[key])]
    if not changed:
        return
    what = ", ".join(f"{key} {before[key]!r} -> {after[key]!r}" for key in changed)
    outcome = ("set back, as determinism.enabled=true pins them" if restore else
               "kept (determinism.enabled=false): the kernel path records them")
    print(f"twinrun: {builder} changed numerics switches while it was built ({what}); {outcome}", flush=True)


def _restore(state: dict) -> None:
    """Set the switches and variables `_current` read back to `state`."""
    torch.use_deterministic_algorithms(state["deterministic_algorithms"],
                                       warn_only=state["deterministic_warn_only"])
    torch.backends.cudnn.benchmark = state["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = state["cudnn_deterministic"]
    if state["float32_matmul_precision"] in MATMUL_PRECISIONS:  # also resets the legacy TF32 alias
        torch.set_float32_matmul_precision(state["float32_matmul_precision"])
    if isinstance(state["cudnn_allow_tf32"], bool):
        torch.backends.cudnn.allow_tf32 = state["cudnn_allow_tf32"]
    for name in ("CUBLAS_WORKSPACE_CONFIG", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        if state[name] is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = state[name]
