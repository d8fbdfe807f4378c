"""The default data set: scikit-learn's 8x8 digits (ships inside the package, no download)."""

from __future__ import annotations

import gzip
import importlib.util
from functools import cache
from pathlib import Path

import numpy as np
import torch

from twinrun.errors import TwinrunError

# The digits set stores pixel intensities as integers 0..16; dividing by half of that maps them to [0, 2].
DIGITS_PIXEL_HALF_RANGE = 8.0
# The last images form the held-out split the probe draws from; the model never trains on them.
N_HELDOUT = 297


def _digits_csv() -> Path:
    """scikit-learn's bundled digits.csv.gz, found without importing sklearn (its import costs
    more CPU than the whole default probe of a small grid)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise TwinrunError("the default data set ships with scikit-learn: pip install scikit-learn (or point "
                           "data._target_ at a builder of your own, docs/bring-your-own.md)")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():  # a file of scikit-learn's own layout, which a release may move
        raise TwinrunError(f"scikit-learn's bundled digits file is not at {path} (this scikit-learn keeps it "
                           "elsewhere): install one that ships it there (constraints.txt pins one), or point "
                           "data._target_ at a builder of your own (docs/bring-your-own.md)")
    return path


@cache
def _digits_pixels() -> np.ndarray:
    """[N, 64] pixel intensities 0..16 (the last CSV column is the label), exactly as
    sklearn.datasets.load_digits reads them; read once per process (plan and job both need it)."""
    with gzip.open(_digits_csv(), "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1]


def load_digits_images() -> torch.Tensor:
    """All 1797 digits as float32 [N, 1, 8, 8], scaled to [-1, 1]."""
    images_u8 = torch.as_tensor(_digits_pixels().reshape(-1, 8, 8), dtype=torch.float32)
    return (images_u8 / DIGITS_PIXEL_HALF_RANGE - 1.0).unsqueeze(1).contiguous()


def _check_total(n_total: int) -> None:
    if n_total <= N_HELDOUT:
        raise ValueError(f"n_total={n_total} leaves no training images; it must exceed {N_HELDOUT}")


def train_indices(n_total: int) -> torch.Tensor:
    """Indices of the training split: every image but the last N_HELDOUT, in order."""
    _check_total(n_total)
    return torch.arange(n_total - N_HELDOUT)


def heldout_indices(n_total: int) -> torch.Tensor:
    """Indices of the held-out split: the last N_HELDOUT images, in order."""
    _check_total(n_total)
    return torch.arange(n_total - N_HELDOUT, n_total)


def sigma_data_of(images: torch.Tensor) -> float:
    """Std of the pixel values, the EDM sigma_data; pass the training split."""
    return float(images.double().std())


def load_heldout_images() -> tuple[torch.Tensor, list[int]]:
    """The probe's data builder: held-out images [M, 1, 8, 8] and their indices in the data set.

    The probe takes the first probe.n_images of them; an image's index keys its noise draws.
    """
    images = load_digits_images()
    ids = heldout_indices(images.shape[0])
    return images[ids], [int(i) for i in ids]


def load_train_and_heldout() -> tuple[tuple[torch.Tensor, list[int]], tuple[torch.Tensor, list[int]]]:
    """The training measure's data builder: ((training images, ids), (held-out images, ids)), each
    [M, 1, 8, 8] with its indices in the data set: the split the committed model was trained on, and
    the split it never saw. An image's id keys its noise draws, never its position in a batch."""
    images = load_digits_images()
    train, heldout = train_indices(images.shape[0]), heldout_indices(images.shape[0])
    return (images[train], [int(i) for i in train]), (images[heldout], [int(i) for i in heldout])
