"""Latent and conditioning caches, as researchers keep them: safetensors files written once from a
pipeline's own encoders (a VAE's latents, a text encoder's embeddings), read by a built-in data builder.

A latent cache holds `latents` [M, C, H, W] (floating) and `ids` [M] (int64, distinct: an id keys a
sample's noise draws). A conditioning cache holds `ids` [M], equal to the latent cache's, and one tensor
per conditioning entry, [M, ...], each fed to the model's forward as the keyword of its name
(twinrun.conditioning). `write_cache` writes either; `load_cache` (the probe's builder) and
`load_train_cache` (training's) read them. Each file is read once into memory as untrusted input
(storage/safetensors_file.py: bounded, a regular file only, its header checked before any payload byte
is read); its sha256 is taken over the bytes parsed and recorded (`recording`) for the run's identity and
report. A missing, damaged or mismatched file is one line naming the file and the key (exit 2).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save

from twinrun.errors import StoreError
from twinrun.files import atomic_write, memory_bytes
from twinrun.storage.safetensors_file import SafetensorsFile

LATENTS = "latents"
IDS = "ids"
_READ: list[dict] = []  # the recording open now (a stack: `recording` blocks nest)


def write_cache(path: str | Path, tensors: dict[str, torch.Tensor], ids) -> Path:
    """Atomically write a cache: `tensors` (e.g. {"latents": [M, C, H, W]}, or the conditioning entries)
    and `ids` [M] (each sample's id in your data set). The same ids, in the same order, in both files."""
    ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
    if IDS in tensors:
        raise ValueError(f"'{IDS}' is written from the ids argument; rename that tensor")
    out = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()} | {IDS: ids.contiguous()}
    for n, t in out.items():
        if t.dim() == 0 or t.shape[0] != len(ids):
            raise ValueError(f"tensor {n!r} has {t.shape[0] if t.dim() else 'no'} rows, the ids {len(ids)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, save(out, metadata={"format": "twinrun-cache/1"}))
    return path


@contextmanager
def recording():
    """Within the block, every cache read is recorded: yields {path: sha256} of the files read."""
    files: dict = {}
    _READ.append(files)
    try:
        yield files
    finally:
        _READ.remove(files)


def read(path: str | Path) -> dict[str, torch.Tensor]:
    """A cache's tensors, parsed from the bytes its digest is taken over (recorded when recording)."""
    path = Path(path)
    # The untrusted reader: a regular file (a FIFO refused without waiting), not sparse, its header's
    # every entry checked against the file's size before one payload byte is read.
    with SafetensorsFile(path, "cache", memory_bytes() // 2) as f:
        tensors, digest = f.tensors_and_sha256()
    for files in _READ:
        files[str(path)] = digest
    return tensors


def _ids(path: Path, tensors: dict) -> torch.Tensor:
    ids = tensors.get(IDS)
    if ids is None:
        raise StoreError(path, f"key '{IDS}': missing; a cache holds each sample's id (write_cache)")
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise StoreError(path, f"key '{IDS}': must be int64 [M], is {ids.dtype} {list(ids.shape)}")
    if len(set(ids.tolist())) != len(ids):
        raise StoreError(path, f"key '{IDS}': the ids repeat; an id keys a sample's noise, so each names one")
    return ids


def load_cache(latents: str, conditioning: str | None = None) -> tuple[torch.Tensor, list[int], dict]:
    """The probe's data builder for caches: (latents [M, C, H, W], ids, {name: [M, ...]}) from a latent
    cache and an optional conditioning cache whose ids must equal the latents'."""
    path = Path(latents)
    tensors = read(path)
    x = tensors.get(LATENTS)
    if x is None:
        raise StoreError(path, f"key '{LATENTS}': missing (keys: {sorted(tensors)[:6]}); write_cache"
                         "(path, {'latents': ...}, ids)")
    if x.dim() != 4 or not x.is_floating_point():
        raise StoreError(path, f"key '{LATENTS}': must be floating [M, C, H, W], is {x.dtype} "
                         f"{list(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise StoreError(path, f"key '{LATENTS}': holds NaN or inf values")
    ids = _ids(path, tensors)
    if len(ids) != x.shape[0]:
        raise StoreError(path, f"key '{IDS}': {len(ids)} ids for {x.shape[0]} latents")
    if len(tensors) > 2:
        raise StoreError(path, f"keys {sorted(set(tensors) - {LATENTS, IDS})}: a latent cache holds only "
                         f"'{LATENTS}' and '{IDS}'; put conditioning in its own cache")
    cond: dict = {}
    if conditioning is not None:
        cpath = Path(conditioning)
        ctensors = read(cpath)
        cids = _ids(cpath, ctensors)
        if not torch.equal(cids, ids):
            where = "in another order" if sorted(cids.tolist()) == sorted(ids.tolist()) else "other samples"
            raise StoreError(cpath, f"key '{IDS}': disagrees with {path}'s ids ({where}); write both caches "
                             "from one list of samples")
        cond = {n: t for n, t in ctensors.items() if n != IDS}
        for n, t in cond.items():
            if t.dim() == 0 or t.shape[0] != len(ids):
                raise StoreError(cpath, f"key {n!r}: leading dimension {t.shape[0] if t.dim() else 'none'}, "
                                 f"not the {len(ids)} samples")
    return x, [int(i) for i in ids], cond


def load_train_cache(train_latents: str, heldout_latents: str, train_conditioning: str | None = None,
                     heldout_conditioning: str | None = None) -> tuple[tuple, tuple]:
    """Training's data builder for caches: ((latents, ids, cond) of the training split, the same of the
    held-out split), each read as `load_cache` reads it."""
    return (load_cache(train_latents, train_conditioning), load_cache(heldout_latents, heldout_conditioning))
