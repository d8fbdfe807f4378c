"""Sample stores (measure=sample): one arm's samples in one chunk and what was read of them, written
whole and read back whole, every tensor checked against its own sha256 and its shape against the chunk.

Tensors: `samples` [n, C, H, W] float32 (what the sampler reached), `loss` [n, L] float32 (the native
model's denoising loss of each sample at the run's loss σs), `features` [n, F] float32 (what the MMD
reads: computed in the job, so the reducer runs no code), `noise_digest` in the metadata: the sha256
of the initial (and, stochastic, per-step) noise the chunk consumed, equal in every arm.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import NotRequired, TypedDict

import safetensors.torch
import torch

from twinrun.errors import StoreError
from twinrun.files import atomic_write, memory_bytes, open_regular
from twinrun.storage.header import HEX64, MAX_STORE_BYTES, TENSOR_SHA256, decode_meta, encode_meta
from twinrun.storage.records import SharedSummary
from twinrun.storage.typed import Checker, check_typed

SAMPLE_STORE_FORMAT = "twinrun-sample-store/1"
TENSORS = ("samples", "loss", "features")


class SampleStoreMeta(TypedDict):
    arm: str
    unit_index: int
    first: int  # the chunk's first sample index (each sample's noise is keyed by its index)
    count: int
    seed: int
    config_hash: str
    noise_digest: str  # sha256 of every noise value the chunk consumed (equal in every arm)
    sampler: str
    steps: int
    loss_sigmas: list[float]
    env: NotRequired[dict | None]
    kernel_path: NotRequired[dict | None]


def write_sample_store(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> str:
    """The chunk's tensors (float32, on the CPU) and metadata, atomically; the file's sha256."""
    tensors = {k: tensors[k].detach().to("cpu", torch.float32).contiguous() for k in TENSORS}
    digests = {k: hashlib.sha256(t.numpy().tobytes()).hexdigest() for k, t in tensors.items()}
    strings = {"format": SAMPLE_STORE_FORMAT, TENSOR_SHA256: json.dumps(digests)}
    strings.update({k: encode_meta(v) for k, v in meta.items()})
    return atomic_write(Path(path), safetensors.torch.save(tensors, metadata=strings))


def verify_sample_store(path: Path, sha256: str | None = None, payload_bytes: int | None = None) -> dict:
    """A sample store checked whole (read_sample_store's checks); its metadata."""
    return read_sample_store(path, sha256)[1]


def read_sample_store(path: Path, sha256: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of a sample store, after its checks: bounded size, the file's sha256 against
    run.json's, the format, the metadata's fields, every tensor's sha256 and shape, no NaN or inf."""
    path = Path(path)
    fd, size = open_regular(path, min(MAX_STORE_BYTES, memory_bytes() // 4), "store")
    try:
        data = os.pread(fd, size, 0)
    except OSError as err:
        raise StoreError(path, f"cannot read ({err.strerror})") from None
    finally:
        os.close(fd)
    if len(data) != size:
        raise StoreError(path, "changed size while being read")
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise StoreError(path, "sha256 does not match run.json: the store was altered or damaged")
    try:  # safetensors never unpickles; a damaged header is its error, named here
        tensors = safetensors.torch.load(data)
        raw = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
        digests = json.loads(raw[TENSOR_SHA256])
    except Exception as err:  # noqa: BLE001 — hostile or damaged bytes end as one named error
        raise StoreError(path, f"not a readable sample store ({type(err).__name__})") from None
    if raw.get("format") != SAMPLE_STORE_FORMAT:
        raise StoreError(path, f"not a twinrun sample store (format {raw.get('format')!r})")
    meta = {k: decode_meta(v) for k, v in raw.items() if k not in ("format", TENSOR_SHA256)}
    check_typed(Checker(path), meta, SampleStoreMeta, "")
    if set(tensors) != set(TENSORS) or not isinstance(digests, dict) or set(digests) != set(TENSORS):
        raise StoreError(path, f"holds tensors {sorted(tensors)}, not {list(TENSORS)}: damaged")
    n = meta["count"]
    for name, t in tensors.items():
        if not (isinstance(digests[name], str) and HEX64.fullmatch(digests[name])):
            raise StoreError(path, f"tensor {name!r} has no sha256 digest in the metadata: damaged")
        if hashlib.sha256(t.numpy().tobytes()).hexdigest() != digests[name]:
            raise StoreError(path, f"tensor {name!r} does not match its sha256: damaged or altered")
        if t.dtype != torch.float32 or t.shape[0] != n or not bool(torch.isfinite(t).all()):
            raise StoreError(path, f"tensor {name!r} is not {n} finite float32 rows: damaged or forged")
    if tensors["loss"].shape != (n, len(meta["loss_sigmas"])):
        raise StoreError(path, "tensor 'loss' does not hold one value per sample and loss σ: damaged")
    return tensors, meta


class SampleSummary(SharedSummary):
    """What one reduction of a sampling run found (analysis/sample_reduce.py): checks, the machinery
    gates, then the reading per chunk (`effects`) and over every sample (`overall`), empty unless every
    check and gate passed."""

    measure: str
    overall: list[dict]
    n_samples: int
    replicate: dict | None
    no_machinery_arm: bool
    post_hoc: NotRequired[dict]
