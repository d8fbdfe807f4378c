"""Real stores from hand-made sums, for tests of the streaming reader and the reducer's pass.

Written as the job writes them: write_store of the probe's fold sums as one tensor per parameter
(twinrun.measures.probe.fold_tensors).
"""

from pathlib import Path

import torch

from twinrun.analysis.scan import scan
from twinrun.measures.probe import fold_tensors
from twinrun.storage.store import StoreReader, write_store


def meta(layout: list[dict], n_folds: int, arm: str = "native", bin_index: int = 0, **extra) -> dict:
    return {"arm": arm, "bin_index": bin_index, "sigma": 0.5, "sigma_cond": 0.5, "n_images": 4 * n_folds,
            "n_draws": 1, "fold_sizes": [4] * n_folds, "draws_digest": "ab" * 32, "config_hash": "0123abcd",
            "layout": layout, **extra}


def write_sums(path: Path, sums: torch.Tensor, meta: dict) -> str:
    """A store of fold sums [n_folds, n_params] float32 laid out as meta's layout; its file's sha256."""
    return write_store(path, fold_tensors(sums, meta["layout"]), meta)


def write_all(root: Path, sums: dict, layout: list[dict]) -> dict:
    """{(arm, bin): [F, P] tensor} -> {(arm, bin): StoreReader} of stores written under root."""
    readers = {}
    for (arm, b), s in sums.items():
        Path(root).mkdir(parents=True, exist_ok=True)
        path = Path(root) / f"{arm}-{b}.safetensors"
        write_sums(path, s.float(), meta(layout, s.shape[0], arm, b))
        readers[arm, b] = StoreReader(path)
    return readers


def scan_sums(root: Path, sums: dict, layout: list[dict], gram_arms: list[str], n_bins: int, names: list[str],
              pairs: list[tuple[str, str]], bases=("native",), groups=None, chunk_params: int = 1_000_000):
    return scan(write_all(root, sums, layout), gram_arms, n_bins, names, groups, list(bases), pairs,
                chunk_params)
