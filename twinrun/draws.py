"""Common random numbers: noise that is a pure function of (seed, bin, image, draw).

Each draw has its own counter-based stream (numpy's Philox, keyed by a sha256 of the
coordinates), generated on the CPU and only then moved to the device. So both arms of a twin
pair, any batch layout, any chunking, rank or world size see the same ε for the same sample,
and adding a bin or an image never reshuffles the others (a bin is keyed by its σ, an image by
its index in the data set).
"""

import hashlib
import struct

import numpy as np
import torch

_STREAM = b"twinrun/probe-noise/v1"


def _key(seed: int, sigma: float, image: int, draw: int) -> np.ndarray:
    # struct packs σ as its exact float64 bits: "0.1" and 0.1000000001 are different bins.
    coords = struct.pack("<qdqq", seed, float(sigma), image, draw)
    digest = hashlib.sha256(_STREAM + coords).digest()
    return np.frombuffer(digest[:16], dtype=np.uint64).copy()


def noise(seed: int, sigma: float, image_ids: list[int], n_draws: int, shape: tuple) -> torch.Tensor:
    """ε of shape [len(image_ids), n_draws, *shape], float32, on the CPU."""
    out = np.empty((len(image_ids), n_draws, *shape), dtype=np.float32)
    for i, image in enumerate(image_ids):
        for d in range(n_draws):
            gen = np.random.Generator(np.random.Philox(key=_key(seed, sigma, int(image), d)))
            out[i, d] = gen.standard_normal(shape, dtype=np.float32)
    return torch.from_numpy(out)


def digest(eps: torch.Tensor, sigma: float) -> str:
    """sha256 of exactly what an arm consumed: σ and the ε bytes (CPU, little-endian float32)."""
    h = hashlib.sha256(struct.pack("<d", float(sigma)))
    h.update(eps.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes())
    return h.hexdigest()


def keyed_normal(stream: bytes, seed: int, coords: tuple[int, ...], shape: tuple) -> torch.Tensor:
    """A float32 standard normal of `shape` on the CPU, a pure function of (stream, seed, coords): e.g. a
    sample's initial noise keyed by its index, or its sampler noise at one step (twinrun/measures/
    samplers.py). Another stream name never shares a draw with the probe's."""
    digest = hashlib.sha256(stream + struct.pack(f"<q{len(coords)}q", seed, *coords)).digest()
    gen = np.random.Generator(np.random.Philox(key=np.frombuffer(digest[:16], dtype=np.uint64).copy()))
    return torch.from_numpy(gen.standard_normal(shape, dtype=np.float32))
