"""Training's common random numbers: which samples every step trains on, and every sample's noise.

The samples of step s are the first `batch_size` of a permutation of the training split drawn from a
stream keyed by (seed, s) alone: the j-th sample of a step is the same whatever the batch is cut into
(train.chunk_samples), in every arm, after any resume. A sample's noise — the normal draw that sets
its σ, then its ε — is keyed by (seed, step, sample id); a held-out image's by (seed, image id). No
stream is keyed by the arm, a position in a batch, the chunking, a rank or a world size. Keys are the
sha256 of the coordinates, fed to numpy's counter-based Philox, drawn on the CPU (as twinrun.draws
does for the probe); a model's own dropout is seeded per step (`dropout_seed`).
"""

import hashlib
import struct
from dataclasses import dataclass

import numpy as np
import torch

_ORDER = b"twinrun/train-order/v1"
_NOISE = b"twinrun/train-noise/v1"
_HELDOUT = b"twinrun/train-heldout/v1"
_DROPOUT = b"twinrun/train-dropout/v1"


def _key(stream: bytes, *coords: int) -> bytes:
    return hashlib.sha256(stream + struct.pack(f"<{len(coords)}q", *coords)).digest()


class Keyed:
    """One Philox bit generator re-keyed for every stream: in the state a fresh Philox(key) starts in
    (counter 0, empty buffer), at a quarter of the cost of building one, which matters where a segment
    keys one stream per sample (test_train.py checks that the two agree). Not shared between threads."""

    def __init__(self):
        self.bits = np.random.Philox(0)
        self.gen = np.random.Generator(self.bits)

    def __call__(self, stream: bytes, *coords: int) -> np.random.Generator:
        key = np.frombuffer(_key(stream, *coords)[:16], dtype=np.uint64).copy()
        self.bits.state = {"bit_generator": "Philox",
                           "state": {"counter": np.zeros(4, np.uint64), "key": key},
                           "buffer": np.zeros(4, np.uint64), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0}
        return self.gen


def fresh(stream: bytes, *coords: int) -> np.random.Generator:
    """The stream's generator built afresh: what a Keyed re-key must equal."""
    key = np.frombuffer(_key(stream, *coords)[:16], dtype=np.uint64).copy()
    return np.random.Generator(np.random.Philox(key=key))


def step_positions(seed: int, step: int, n_train: int, batch_size: int, keyed=fresh) -> np.ndarray:
    """Positions (into the training split) of step `step`'s samples: a prefix of one keyed permutation,
    so no sample repeats within a step and the order never depends on how the batch is cut."""
    return keyed(_ORDER, seed, step).permutation(n_train)[:batch_size]


def sample_noise(seed: int, step: int, sample_id: int, shape: tuple,
                 keyed=fresh) -> tuple[np.float32, np.ndarray]:
    """(the standard normal that sets the sample's σ, its ε of `shape`), float32."""
    gen = keyed(_NOISE, seed, step, sample_id)
    return gen.standard_normal(dtype=np.float32), gen.standard_normal(shape, dtype=np.float32)


def dropout_seed(seed: int, step: int) -> int:
    """The seed of torch's generator for one step's forward and backward (a model's own dropout): the
    same in every arm at a step. Within the step it follows the batch layout, which every arm shares."""
    return int.from_bytes(_key(_DROPOUT, seed, step)[:8], "little") >> 1


@dataclass
class Segment:
    """What the steps of one training unit consume, drawn once and read by every arm."""

    steps: list[int]  # the optimizer steps, 1-based
    positions: torch.Tensor  # [K, B] int64: each step's samples, as positions in the training split
    normal: torch.Tensor  # [K, B] float32: the normal draws that set each sample's σ
    eps: torch.Tensor  # [K, B, *image shape] float32
    digest: str  # sha256 of ids, normals and ε: equal in every arm's store of the unit


def draw_segment(seed: int, steps: list[int], train_ids: list[int], batch_size: int, shape: tuple) -> Segment:
    """Every step's samples and noise for `steps`, on the CPU."""
    keyed = Keyed()
    positions = (np.stack([step_positions(seed, s, len(train_ids), batch_size, keyed) for s in steps])
                 if steps else np.zeros((0, batch_size), dtype=np.int64))
    normal = np.empty(positions.shape, dtype=np.float32)
    eps = np.empty((*positions.shape, *shape), dtype=np.float32)
    for k, step in enumerate(steps):
        for j, pos in enumerate(positions[k]):
            normal[k, j], eps[k, j] = sample_noise(seed, step, train_ids[pos], shape, keyed)
    ids = np.asarray(train_ids, dtype=np.int64)[positions.astype(np.int64)]
    return Segment(steps, torch.from_numpy(positions.astype(np.int64)), torch.from_numpy(normal),
                   torch.from_numpy(eps), digest(ids, normal, eps))


def heldout_draws(seed: int, ids: list[int], shape: tuple) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(normals [N], ε [N, *shape], digest) of the held-out images: one keyed draw each, the same at
    every stored step and in every arm, so two arms' held-out losses pair image by image."""
    normal = np.empty(len(ids), dtype=np.float32)
    eps = np.empty((len(ids), *shape), dtype=np.float32)
    keyed = Keyed()
    for i, image in enumerate(ids):
        gen = keyed(_HELDOUT, seed, int(image))
        normal[i] = gen.standard_normal(dtype=np.float32)
        eps[i] = gen.standard_normal(shape, dtype=np.float32)
    return (torch.from_numpy(normal), torch.from_numpy(eps),
            digest(np.asarray(ids, dtype=np.int64), normal, eps))


def digest(ids: np.ndarray, normal: np.ndarray, eps: np.ndarray) -> str:
    """sha256 of exactly what was consumed: sample ids (int64) and the draws (float32), little-endian."""
    h = hashlib.sha256(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(normal, dtype="<f4").tobytes())
    h.update(np.ascontiguousarray(eps, dtype="<f4").tobytes())
    return h.hexdigest()


_USER = b"twinrun/train-user/v1"


class SampleNoise:
    """The randomness a step of your own draws from (`train.step._target_`): every draw is keyed by (seed,
    step, sample id, the draw's number within the step), so sample j's draws are the same in every arm,
    however the batch is cut into micro-batches and chunks, and after any resume. `normal(*shape)` and
    `uniform(*shape)` return [B, *shape] float32 on the batch's device, row j from sample j's stream."""

    def __init__(self, seed: int, step: int, ids: list[int], device: torch.device):
        self.seed, self.step, self.ids, self.device = seed, step, [int(i) for i in ids], device
        self.calls = 0
        self.keyed = Keyed()

    def _draw(self, shape: tuple, how: str) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        out = np.empty((len(self.ids), *shape), dtype=np.float32)
        for j, sample in enumerate(self.ids):
            gen = self.keyed(_USER, self.seed, self.step, sample, call)
            out[j] = (gen.standard_normal(shape, dtype=np.float32) if how == "normal"
                      else gen.random(shape, dtype=np.float32))
        return torch.from_numpy(out).to(self.device)

    def normal(self, *shape: int) -> torch.Tensor:
        return self._draw(tuple(shape), "normal")

    def uniform(self, *shape: int) -> torch.Tensor:
        return self._draw(tuple(shape), "uniform")
