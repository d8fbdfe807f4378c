"""The machine and the libraries a number was computed with, as the kernel path records them: torch's
build and the numerics packages installed, the measuring GPU, the CPU and its vector ISA, thread
counts, the BLAS/oneDNN/OpenMP backend (twinrun/provenance/fingerprint.py says why each can move bits)."""

import email.message
import email.parser
import hashlib
import importlib.metadata
import platform
import re
from pathlib import Path

import torch

# Installed packages (normalised names, prefixes) that choose the kernels a probe runs.
# peft: a LoRA adapter's layers are peft's (its forward, merge and scaling arithmetic), as a network's are
# diffusers'.
NUMERICS_PACKAGES = ("torch", "triton", "pytorch-triton", "nvidia-", "cuda-", "diffusers", "peft", "xformers",
                     "flash-attn", "transformers", "accelerate", "numpy", "safetensors", "intel-openmp",
                     "mkl")


ISA_FLAG = re.compile(r"avx|sse|amx|fma|f16c|vnni|bf16|fp16|asimd|sve|neon")


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


def _installed_packages() -> dict:
    """{normalised name: version} of every installed distribution, read from its metadata's headers (as
    importlib.metadata's `metadata["Name"]` and `version` read them). Only the headers are parsed: the
    body after them is a package's long description, and parsing it whole, twice (once for the name and
    again for the version), was nearly all of a fingerprint's time (0.15 s of 0.17 s, 183 packages)."""
    packages = {}
    for dist in importlib.metadata.distributions():
        headers = _metadata_headers(dist)
        name = headers["Name"]
        if name:
            packages[re.sub(r"[-_.]+", "-", name).lower()] = headers["Version"]
    return packages


def _metadata_headers(dist: importlib.metadata.Distribution) -> email.message.Message:
    """The distribution's metadata file, the one `Distribution.metadata` reads (METADATA, else PKG-INFO,
    else an old egg-info file itself), parsed by the same parser up to its first empty line, where that
    parser's headers end: the same headers. None found: no headers (no name, so left out)."""
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or dist.read_text("") or ""
    return email.parser.HeaderParser().parsestr(text[:_headers_end(text)])


# The email parser's line ends (feedparser's NLCRE_crack): "\r\n" is one, a lone "\r" or "\n" another.
_EOL = re.compile(r"\r\n|\r|\n")


def _headers_end(text: str) -> int:
    """Where the first empty line starts (the text's end if none): nothing after it is a header."""
    line_start = 0
    for eol in _EOL.finditer(text):
        if eol.start() == line_start:
            return line_start
        line_start = eol.end()
    return len(text)


def _first_version(packages: dict, *prefixes: str) -> str | None:
    hits = sorted(f"{n}=={v}" for n, v in packages.items() if n.startswith(prefixes))
    return ";".join(hits) or None


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
